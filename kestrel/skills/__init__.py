"""Skills: query, caption, point and detect as step-wise state machines.

The one implementation of each skill's token logic (prompt, suppression, stopping, result
parsing), driven both by the eager reference path and by the engine's scheduler. Model
operations come in through :class:`SkillOps`; nothing here imports model code.
"""

from __future__ import annotations

from kestrel.skills.base import Draw, PromptToken, Skill, SkillOps, TextSink
from kestrel.skills.chat import ChatSkill, ChatTurn, chat_prompt
from kestrel.skills.grounding import GroundingChunk, grounding_chunks
from kestrel.skills.prompts import PromptError
from kestrel.skills.region import DetectSkill, PointSkill, RegionSkill, box_dict, point_dict
from kestrel.skills.segment import NoPathError, PathParser, SegmentSkill, segment_prompt
from kestrel.skills.settings import DEFAULT_SETTINGS, Settings, family_settings, parse_settings
from kestrel.skills.text import CaptionSkill, QuerySkill, TextPhase

__all__ = [
    "DEFAULT_SETTINGS",
    "CaptionSkill",
    "ChatSkill",
    "ChatTurn",
    "DetectSkill",
    "Draw",
    "GroundingChunk",
    "NoPathError",
    "PathParser",
    "PointSkill",
    "PromptError",
    "PromptToken",
    "QuerySkill",
    "RegionSkill",
    "SegmentSkill",
    "Settings",
    "Skill",
    "SkillOps",
    "TextPhase",
    "TextSink",
    "box_dict",
    "chat_prompt",
    "family_settings",
    "grounding_chunks",
    "parse_settings",
    "point_dict",
    "segment_prompt",
]
