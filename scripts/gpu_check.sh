#!/usr/bin/env bash
# One-shot GPU check, ~7.5-8 minutes on an H200 by default (390 s at 6b74b07 with the vision
# step, capped at 60 s, which the default now leaves out; the Moondream 3 step, capped at
# 130 s, and the cot30 rows are not yet timed on a GPU), ~9 with SKIP="" (docs/benchmarks.md;
# the first engine start also compiles the Triton decode kernel's launch configurations it
# measures):
#   1. the import and backend probe (torch, the device, flash-attn-4 for the `fa` backend,
#      pyvips and its version);
#   2. scripts/bench_gpu.py: direct, CoT-64 and the ~30-token CoT (cot30), greedy and default
#      sampling, batch 1 and 64, 16 threads submitting while the engine starts (decode
#      attention per bucket: whichever kernel the start-up measurement chose), and where a lone
#      request's time goes; then (step "md3", ~2 minutes, capped at 130 s) the same workload
#      on a random Moondream 3 of the published dimensions with FP8 experts, made on the device
#      (direct, CoT-64, cot30; greedy; batch 1 and 64; one round, 64 requests a row at batch
#      64 but 16 at batch 1, where each CoT-64 request is 130 decode steps one after the
#      other: cut so that the step fits its 2 minutes, the whole default check 8);
#      then scripts/bench_crop_parts.py: a chart-sized (800 x 600) image's crops serially, on
#      libvips threads, and in 2, 4, 8 parts on the host's cores, and made on the GPU from the
#      uploaded image (the runtime's default), each up to the encoder's input on the GPU
#      (~20 s; after the bench, so that its load does not mark the bench's figures BUSY);
#      then scripts/bench_vision.py: the vision encoder on 10 crops with each attention kernel,
#      replayed from a CUDA graph, its matrix products alone, and its kernels by device time;
#   3. pytest -m gpu tests/gpu;
#   4. scripts/bench_gpu_runtime.py with each bucket's measured decode kernel (as served):
#      decode step ms by batch, kernels, TTFT, and the vision encoder beside batch-64 decode
#      steps on a second stream; on request (SKIP without them) once more with FlashAttention's
#      decode and once with the Triton kernel forced (KESTREL_DECODE_KERNEL=fa / triton), and
#      scripts/bench_attention.py --only gpu (the decode attention calls alone, fa vs Triton);
#   5. one JSON line: the probe, the pytest counts, req/s per row, failed requests, failed
#      captures, the start-up decode kernel choice per bucket, decode step ms by batch for
#      each runtime run, crop ms by variant, the vision encoder's ms by attention kernel,
#      the encoder / decode overlap (the last line).
# On the GPU machine here, run it through the staged FlashAttention 4 (see the GPU tools' README):
#   bash .gpu/env/gpu-env --stash .gpu/pN bash scripts/gpu_check.sh
# Logs go to $OUT (default /tmp/kestrel-gpu-check). PYTHON overrides the interpreter. Every step
# is cut short to fit BUDGET seconds (default 560), so the summary line comes within 10 minutes.
# SKIP names steps left out: any of md3, vision, auto, fa, triton, attention (default "vision fa
# triton attention": the encoder bench and the forced-kernel runs; SKIP="" runs every step,
# ~8 minutes on an H200; SKIP="fa triton attention" adds the encoder bench back). A shorter
# check for a lease's last minutes: SAMPLING=greedy (the bench's rows; default both) and
# SKIP="vision fa triton attention auto".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kestrel-gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
t0=$(date +%s)
BUDGET=${BUDGET:-560}  # seconds for all steps: the summary line is printed within it
SAMPLING=${SAMPLING:-greedy,default}
SKIP=" ${SKIP-vision fa triton attention} "  # set but empty: nothing skipped
runs() { [[ $SKIP != *" $1 "* ]]; }  # whether step $1 runs (SKIP does not name it)
cap() {  # a step's timeout: at most $1 s, and no more than what the budget has left
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  (( left < $1 )) && set -- "$left"
  (( $1 < 5 )) && set -- 5
  echo "$1"
}

echo "== 1/4 probe" >&2
timeout "$(cap 60)" "$PY" - > "$OUT/probe.json" 2> "$OUT/probe.log" <<'PYEOF'
import json

import torch

from kestrel_kernels import fa_backend

out = {"torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
probe = fa_backend.probe("cuda")
out["fa"] = "ok" if probe.ok else probe.reason
try:
    import pyvips

    out["pyvips"] = "ok"
    out["pyvips_version"] = (f"{pyvips.__version__}, libvips "
                             + ".".join(str(pyvips.version(i)) for i in range(3)))
except Exception as exc:  # reported, not fatal: the crops then fail, and say so
    out["pyvips"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
PYEOF
probe_rc=$?
cat "$OUT/probe.json" >&2

echo "== 2/4 bench" >&2
timeout "$(cap 200)" "$PY" scripts/bench_gpu.py --batches 1,64 --cot-tokens 64 --rounds 1 \
  --modes direct,cot,cot30 --sampling "$SAMPLING" --startup-threads 16 --allow-busy --summary \
  > "$OUT/bench.log" 2>&1
bench_rc=$?
grep -E '^(BUSY )?\| ' "$OUT/bench.log" >&2

echo "== 2b/4 bench, Moondream 3 (random, FP8 experts, made on the device)" >&2
bench_md3_rc=""  # left out (SKIP=md3): null in the summary
if runs md3; then
  timeout "$(cap 130)" "$PY" scripts/bench_gpu.py --family md3 --batches 1,64 \
    --cot-tokens 64 --requests 16,64 --rounds 1 --modes direct,cot,cot30 --sampling greedy \
    --startup-threads 4 --allow-busy --summary > "$OUT/bench_md3.log" 2>&1
  bench_md3_rc=$?
  grep -E '^(BUSY )?\| ' "$OUT/bench_md3.log" >&2
fi

echo "== host: one image's crops serially, on libvips threads, in 2-8 parts" >&2
# the bench's charts are 640-900 x 480-640: their crops are enlarged, libvips's costliest path
timeout "$(cap 45)" "$PY" scripts/bench_crop_parts.py --parts 2,4,8 --rounds 3 --repeats 10 \
  --size 600x800 --device cuda --allow-busy > "$OUT/crops.log" 2>&1
grep -E '^(BUSY )?\| (serial|1 part,|[0-9]+ parts|on the device)[ ,]' "$OUT/crops.log" >&2

echo "== vision encoder: attention kernels, the CUDA graph, the matrix products alone" >&2
runs vision && timeout "$(cap 60)" "$PY" scripts/bench_vision.py --crops 10 --rounds 5 \
  --allow-busy > "$OUT/vision.log" 2>&1
runs vision && grep -E '^(BUSY )?(\| |not timed|TFLOP|default encoder)' "$OUT/vision.log" >&2

echo "== 3/4 pytest -m gpu tests/gpu" >&2
per_test=()  # a test that hangs fails alone instead of taking the step's whole budget
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 120)
timeout "$(cap 260)" "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
  ${per_test[@]+"${per_test[@]}"} > "$OUT/pytest.log" 2>&1
pytest_rc=$?
tail -3 "$OUT/pytest.log" >&2

echo "== 4/4 decode: the runtime bench (the measured kernels; fa / triton forced on request)" >&2
for kernel in auto fa triton; do
  runs "$kernel" || continue
  extra=(); [[ $kernel == auto ]] && extra=(--overlap)  # the encoder beside decode, measured once
  forced=(); [[ $kernel != auto ]] && forced=("KESTREL_DECODE_KERNEL=$kernel")
  env ${forced[@]+"${forced[@]}"} timeout "$(cap 90)" "$PY" scripts/bench_gpu_runtime.py \
    --qa-requests 32 ${extra[@]+"${extra[@]}"} > "$OUT/runtime_$kernel.log" 2>&1
  grep -E '^(BUSY )?\| [0-9]' "$OUT/runtime_$kernel.log" | sed "s/^/$kernel /" >&2
done
runs attention && timeout "$(cap 60)" "$PY" scripts/bench_attention.py --only gpu \
  --json "$OUT/attention.json" > "$OUT/attention.log" 2>&1

"$PY" - "$OUT" "$probe_rc" "$pytest_rc" "$bench_rc" "$(( $(date +%s) - t0 ))" "$bench_md3_rc" \
  <<'PYEOF'
import json
import re
import sys
from pathlib import Path

out, probe_rc, pytest_rc, bench_rc, seconds = Path(sys.argv[1]), *map(int, sys.argv[2:6])
md3_rc = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] else None
try:
    probe = json.loads((out / "probe.json").read_text())
except (OSError, ValueError):
    probe = None
log = (out / "pytest.log").read_text(errors="replace") if (out / "pytest.log").exists() else ""
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", log)}
def summary_line(name: str) -> dict | None:
    """bench_gpu.py's --summary line in log ``name`` (None if it did not print one)."""
    path = out / name
    for line in reversed(path.read_text(errors="replace").splitlines() if path.exists() else []):
        if line.startswith("{") and '"req_s"' in line:
            return json.loads(line)
    return None


bench, md3 = summary_line("bench.log"), summary_line("bench_md3.log")
md3_keys = ("req_s", "failed_requests", "failed_captures", "captured",
            "failed_prefill_captures", "prefill_captured")

def decode_ms(kernel: str) -> dict | None:
    """Decode step ms by batch, from bench_gpu_runtime's table (None if it did not run)."""
    path = out / f"runtime_{kernel}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    rows = re.findall(r"^(?:BUSY )?\| (\d+) \| ([\d.]+) \|", text, re.M)  # BUSY: --allow-busy
    return {int(b): float(ms) for b, ms in rows} or None


def overlap() -> dict | None:
    """bench_overlap's medians and ``hidden`` from the runtime run (None if it did not run)."""
    path = out / "runtime_auto.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    found = re.findall(r"^overlap: (\{.*\})$", text, re.M)
    return json.loads(found[-1]) if found else None


def vision() -> dict | None:
    """bench_vision's encoder ms and TFLOP/s by variant, and what it could not time."""
    path = out / "vision.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    found = re.findall(r"^(?:BUSY )?vision: (\{.*\})$", text, re.M)
    return json.loads(found[-1]) if found else None


def crops_ms() -> dict | None:
    """One image's crops, ms by variant (bench_crop_parts' table; None if it did not run)."""
    path = out / "crops.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    variant = (r"serial|1 part, libvips threads|\d+ parts|on the device, matrix products"
               r"|on the device")
    rows = re.findall(rf"^(?:BUSY )?\| ({variant}) \| ([\d.]+)", text, re.M)
    size = re.findall(r"^(?:BUSY )?(\d+ x \d+): \d+ crops", text, re.M)
    if not rows:
        return None
    return {"image": size[-1] if size else None, **{n: float(ms) for n, ms in rows}}


print(json.dumps({
    "probe": probe, "probe_rc": probe_rc,
    "pytest": {**counts, "rc": pytest_rc},
    "req_s": bench["req_s"] if bench else None,
    "batch1_ms": bench.get("batch1_ms") if bench else None,
    "failed_requests": bench["failed_requests"] if bench else None,
    "failed_captures": bench["failed_captures"] if bench else None,
    "captured": bench["captured"] if bench else None,
    "failed_prefill_captures": bench.get("failed_prefill_captures") if bench else None,
    "md3": {**{k: md3.get(k) for k in md3_keys}, "rc": md3_rc} if md3 else {"rc": md3_rc},
    "crops_on_device": bench.get("crops_on_device") if bench else None,
    "decode_kernels": bench.get("decode_kernels") if bench else None,
    "decode_step_ms": {k: decode_ms(k) for k in ("auto", "fa", "triton")},
    "crops_ms": crops_ms(),
    "vision": vision(),
    "overlap": overlap(),
    "bench_rc": bench_rc, "seconds": seconds,
}))
PYEOF
