"""Golden conformance, float32 on CPU: every entry of the fixture's golden.json (tiling cases,
images, generation cases, region primitives) within the tolerance group golden.json gives.

Runs on every bundled fixture (Moondream 2: md2-tiny-a, Moondream 3: md3-tiny-a); point
KESTREL_FIXTURE_DIR at another fixture directory of the same format to run it alone instead.
Each test takes ``fx``, the fixture directory (session-scoped, so a model loads once per fixture).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kestrel.crops.device import make_crops
from kestrel.crops.overlap import overlap_crops, select_tiling
from kestrel.crops.resample import crop_plan
from kestrel.images import load_image
from kestrel.moondream.region import encode_coordinate, encode_size, spatial_ref_tokens
from kestrel.moondream.vision import normalize_pixels
from kestrel.skills.prompts import token_ids
from tests.conformance.cases import check_region_case, check_text_case, run_case
from tests.conformance.golden import assert_close, fixture_params

FIXTURES = fixture_params()
TILINGS = fixture_params(
    lambda m: [(f"{t['height']}x{t['width']}-{t['max_crops']}", t) for t in m["tiling_cases"]]
)
IMAGES = fixture_params(lambda m: [(im["name"], im["name"]) for im in m["images"]])
CASES = fixture_params(lambda m: [(c["id"], c) for c in m["cases"]])
TEXT = [p for p in CASES if p.values[1]["kind"] not in ("point", "detect")]
REGION = [p for p in CASES if p.values[1]["kind"] in ("point", "detect")]
SESSION = {"scope": "session"}


def _tol(golden, case=None):
    return lambda group: golden.tol(group, case)


# ------------------------------------------------------------------------------- tiling / pixels
@pytest.mark.parametrize(("fx", "tc"), TILINGS, **SESSION)
def test_tiling_case(fx, tc, fp32):
    vc = fp32.model.config.vision
    assert select_tiling(*tc["select_tiling_args"]) == tuple(tc["tiling"])
    rows, cols = tc["tiling"]
    assert 1 + rows * cols == tc["n_crops"]
    margin = vc.overlap_margin * vc.enc_patch_size
    window = (vc.grid_side - 2 * vc.overlap_margin) * vc.enc_patch_size
    # The arguments are the image size minus both margins, as overlap_crops computes them.
    h, w = tc["height"] - 2 * margin, tc["width"] - 2 * margin
    assert tc["select_tiling_args"][:3] == [h, w, window]
    if tc["config_max_crops"]:
        assert tc["max_crops"] == vc.max_crops
    assert [rows * window + 2 * margin, cols * window + 2 * margin] == tc["resized_hw"]


@pytest.mark.parametrize("fx", FIXTURES, **SESSION)
def test_pixel_lut(fx, golden):
    levels = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1).repeat(3, axis=3)
    px = normalize_pixels(levels, torch.float32)  # [1, 3, 16, 16]
    lut = golden.tensors[golden.meta["pixel_lut"]["tensor"]]
    assert torch.equal(px[0, 0].flatten(), lut)


@pytest.mark.parametrize(("fx", "name"), IMAGES, **SESSION)
def test_image_crops(fx, name, golden, fp32):
    im = golden.image(name)
    # background=None: the reference's convert("RGB") drops alpha (the RGBA fixture).
    pixels = load_image(golden.dir / im["file"], background=None)
    crops = overlap_crops(pixels, fp32.model.config.vision)
    assert crops.tiling == tuple(im["tiling"])
    assert crops.n_crops == im["n_crops"]
    ref = golden.crops_u8(name)
    assert [int(c.sum(dtype=np.int64)) for c in ref] == im["crop_u8_sums"]
    assert np.array_equal(crops.crops, ref), "crops differ from the reference's libvips crops"


@pytest.mark.parametrize(("fx", "name"), IMAGES, **SESSION)
def test_image_crops_made_as_tensors(fx, name, golden, fp32):
    """The crops a device makes (``device_crops.make_crops``, here on the CPU) are the
    reference's libvips bytes too."""
    pixels = load_image(golden.dir / golden.image(name)["file"], background=None)
    plan = crop_plan(pixels.shape[0], pixels.shape[1], fp32.model.config.vision)
    made = make_crops(torch.from_numpy(pixels), plan).numpy()
    assert np.array_equal(made, golden.crops_u8(name)), "tensor crops differ from the reference's"


# ------------------------------------------------------------------------------- vision / prefix
@pytest.mark.parametrize(("fx", "name"), IMAGES, **SESSION)
def test_image_vision(fx, name, golden, fp32):
    im, T = golden.image(name), golden.tensors
    out = fp32.vision(name)
    for key in ("proj_input", "img_emb"):
        atol, rtol = golden.tol(key)
        assert_close(getattr(out, key), T[im["tensors"][key]], atol, rtol, f"{key}[{name}]", key)
    f = out.features.float()
    stats = torch.stack([f.sum(dim=(1, 2)), f.abs().sum(dim=(1, 2))], dim=1)  # [N, 2]
    atol, rtol = golden.tol("features_crop_stats")
    key = im["tensors"]["features_crop_stats"]
    assert_close(stats, T[key], atol, rtol, f"features_crop_stats[{name}]", "features_crop_stats")


@pytest.mark.parametrize(("fx", "name"), IMAGES, **SESSION)
def test_image_kv_stats(fx, name, golden, fp32):
    """K and V of the BOS + image prefix: [layer, K/V, (sum, sum of squares) over head_dim,
    head, position]. Sums over head_dim do not depend on the rotary output layout."""
    enc = fp32.encoded(name)
    kv = torch.stack([torch.stack(enc.k), torch.stack(enc.v)], dim=1).float()  # [L, 2, P, H, D]
    stats = torch.stack([kv.sum(-1), (kv * kv).sum(-1)], dim=2)  # [L, 2, 2, P, H]
    atol, rtol = golden.tol("kv_stats")
    ref = golden.tensors[golden.image(name)["tensors"]["kv_stats"]]
    assert_close(stats.permute(0, 1, 2, 4, 3), ref, atol, rtol, f"kv_stats[{name}]", "kv_stats")


@pytest.mark.parametrize("fx", FIXTURES, **SESSION)
def test_encode_image_end_to_end(fx, golden, fp32):
    """The full path from the image file (load, crop, normalize, vision, prefix) on the first
    image equals the PNG-crop path, so the per-stage checks above cover what users run."""
    name = golden.meta["images"][0]["name"]
    enc = fp32.eager.encode_image(golden.dir / golden.image(name)["file"])
    atol, rtol = golden.tol("img_emb")
    ref = golden.tensors[golden.image(name)["tensors"]["img_emb"]]
    assert_close(enc.img_emb, ref, atol, rtol, f"img_emb_end_to_end[{name}]", "img_emb")
    assert all(torch.equal(a, b) for a, b in zip(enc.k, fp32.encoded(name).k, strict=True))


# ------------------------------------------------------------------------------- prompts
@pytest.mark.parametrize(("fx", "case"), CASES, **SESSION)
def test_prompt(fx, case, golden, fp32):
    """Prompt ids and their parts exactly as the reference prefilled them."""
    out = run_case(fp32, case)
    assert list(out.prompt_ids) == case["prompt_ids"]
    assert [i for part in case["prompt_parts"].values() for i in part] == case["prompt_ids"]
    tok = fp32.eager.tokenizer
    parts = case["prompt_parts"]
    if "question" in parts:
        assert tok.encode(case["question"]) == parts["question"]
    if "object" in parts:
        assert tok.encode(" " + case["object"]) == parts["object"]
    if case.get("spatial_refs"):
        spatial = spatial_ref_tokens(case["spatial_refs"], fp32.model.config.region)
        assert token_ids(spatial, fp32.model.config.tokenizer) == parts["spatial"]
    if case.get("image"):
        assert case["start_pos"] == fp32.model.config.prefix_len
        assert golden.image(case["image"])["encoded_pos"] == fp32.model.config.prefix_len
    else:
        assert case["start_pos"] == 0


# ------------------------------------------------------------------------------- generation
@pytest.mark.parametrize(("fx", "case"), TEXT, **SESSION)
def test_text_case(fx, case, golden, fp32):
    check_text_case(golden, case, run_case(fp32, case), _tol(golden, case))


@pytest.mark.parametrize(("fx", "case"), REGION, **SESSION)
def test_region_case(fx, case, golden, fp32):
    check_region_case(golden, case, run_case(fp32, case), _tol(golden, case))


@pytest.mark.parametrize("fx", FIXTURES, **SESSION)
def test_region_primitives(fx, golden, fp32):
    rp, T = golden.meta["region_primitives"], golden.tensors
    atol, rtol = golden.tol("region_primitives")
    with torch.inference_mode():
        coords = encode_coordinate(torch.tensor(rp["coords"]), fp32.model.region)
        sizes = encode_size(torch.tensor(rp["sizes"]), fp32.model.region)
    assert_close(
        coords,
        T[rp["tensors"]["encode_coordinate"]],
        atol,
        rtol,
        "encode_coordinate",
        "region_primitives",
    )
    assert_close(
        sizes, T[rp["tensors"]["encode_size"]], atol, rtol, "encode_size", "region_primitives"
    )


@pytest.mark.parametrize("fx", FIXTURES, **SESSION)
def test_every_golden_tensor_is_checked(fx, golden):
    """Guard against a fixture growing tensors this suite would silently ignore (the Moondream 3
    ones, routing, tau and activation primitives, are checked in test_golden_md3.py)."""
    meta = golden.meta
    known = {meta["pixel_lut"]["tensor"]}
    known |= {v for im in meta["images"] for v in im["tensors"].values()}
    known |= {v for c in meta["cases"] for v in c["tensors"].values()}
    known |= set(meta["region_primitives"]["tensors"].values())
    if "activation_primitives" in meta:
        known |= {f"primitives.{k}" for k in meta["activation_primitives"]["tensors"]}
    assert set(meta["tensor_index"]) <= known
    kinds = {c["kind"] for c in meta["cases"]}
    assert kinds <= {"query", "query_reasoning", "caption", "point", "detect"}
