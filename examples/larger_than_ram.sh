#!/usr/bin/env bash
# A model larger than this machine's RAM, both ways, with one command:
#   1. plain PyTorch (fp32 weights, bf16 autocast, AdamW) under an address-space limit:
#      it runs out of memory, cleanly (examples/plain_pytorch_oom.py);
#   2. the same GPT with offload, parameters and optimizer on NVMe, for a few steps, while
#      the process's peak resident memory stays within RSS_BUDGET (examples/train_gpt.py).
# Each under /usr/bin/time -v (its "Maximum resident set size" is the kernel's VmHWM).
#
#   examples/larger_than_ram.sh                     # 4b preset, 3 steps, logs in ./bigrun
#   SIZE=1b STEPS=2 OUT=/tmp/run examples/larger_than_ram.sh
#
# Settings (environment): SIZE (train_gpt.py preset, default 4b), STEPS (3), SEQ (32),
# BATCH (1), OUT (logs, default ./bigrun under the current directory), NVME (swap directory on a local disk, default
# $OUT/swap; not tmpfs), PINNED (staging pool bytes, default 1.2e9: one 4b block's working
# set), RSS_BUDGET (default 4GiB), MOMENTS (fp32; bf16 saves 4 B/param of disk),
# CLIP (gradient clipping, default 0: every unit is then updated during backward and its
# fp32 gradient shard is transient, 4 B/param less host memory; 1.0 keeps them all),
# RAM (host memory for units kept in RAM instead of on NVMe, e.g. 12GiB: parameter shards
# first, then optimizer states; default 0, every unit on NVMe; the RSS budget grows by it),
# SKIP_PLAIN=1 to skip step 1, DRY_RUN=1 to stop after the checks. It refuses to start when MemAvailable is below the planner's
# host figure plus 2 GiB, or the disk below the swap files plus 5%: on a shared machine the
# kernel's OOM killer must never be the one who says no.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SIZE="${SIZE:-4b}"
STEPS="${STEPS:-3}"
SEQ="${SEQ:-32}"
BATCH="${BATCH:-1}"
OUT="${OUT:-$PWD/bigrun}"
NVME="${NVME:-$OUT/swap}"
PINNED="${PINNED:-1200000000}"
RSS_GIVEN="${RSS_BUDGET:-}"
RSS_BUDGET="${RSS_BUDGET:-4GiB}"
MOMENTS="${MOMENTS:-fp32}"
CLIP="${CLIP:-0}"
RAM="${RAM:-0}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT" "$NVME"
bytes_of() { (cd "$HERE/.." && "$PY" -c 'import sys; from offload.sizes import parse_bytes; print(parse_bytes(sys.argv[1]))' "$1"); }
RAM_BYTES=$(bytes_of "$RAM")
if [[ -z "$RSS_GIVEN" && "$RAM_BYTES" != 0 ]]; then  # the default budget grows by RAM
    RSS_BUDGET=$(( $(bytes_of "$RSS_BUDGET") + RAM_BYTES ))
fi
RAM_FLAGS=()
[[ "$RAM_BYTES" != 0 ]] && RAM_FLAGS=(--ram-budget "$RAM_BYTES")

# The planner's figures for this model and placement, and the machine's room for them.
read -r HOST_NEED NVME_NEED < <(cd "$HERE" && "$PY" -c '
import sys, torch, train_gpt
from offload.plan import plan, make_machine
size, seq, pinned, moments, nvme, clip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], float(sys.argv[6])
layers, d, heads = train_gpt.GPT_PRESETS[size]
with torch.device("meta"):
    m = train_gpt.GPT(8192, d, layers, heads, seq, qkv_bias=True)
cfg = {"precision": {"dtype": "bf16"}, "optimizer": {"moments_dtype": moments}, "gradient_clipping": clip,
       "offload": {"param_tier": "nvme", "optimizer_tier": "nvme", "nvme_path": nvme,
                   "pinned_budget_bytes": pinned}}
e = plan(m, machine=make_machine(cpu_mem=1 << 50, nvme_free=1 << 50), config=cfg).estimate("nvme", "nvme")
print(e.per_rank.host + e.per_rank.pinned + e.working_device_bytes, e.per_rank.nvme)
' "$SIZE" "$SEQ" "$PINNED" "$MOMENTS" "$NVME" "$CLIP") || true
[[ -n "${NVME_NEED:-}" ]] || { echo "the planner failed (see above)" >&2; exit 1; }
AVAIL=$(awk '/^MemAvailable:/ {printf "%.0f", $2 * 1024}' /proc/meminfo)
DISK_FREE=$(df --output=avail -B1 "$NVME" | tail -1)
gib() { awk -v b="$1" 'BEGIN {printf "%.1f GiB", b / 2^30}'; }
echo "planner: host $(gib "$HOST_NEED") (gradient shards + staging pool + working buffers), swap files $(gib "$NVME_NEED")"
echo "machine: MemAvailable $(gib "$AVAIL"), free under $NVME $(gib "$DISK_FREE")"
HOST_NEED=$(( HOST_NEED + RAM_BYTES ))
if (( AVAIL < HOST_NEED + (2 << 30) )); then
    echo "refusing: MemAvailable $(gib "$AVAIL") < planner's host figure + 2 GiB; wait for memory to free up" >&2
    exit 2
fi
if (( DISK_FREE < NVME_NEED + NVME_NEED / 20 )); then
    echo "refusing: $(gib "$DISK_FREE") free under $NVME < swap files $(gib "$NVME_NEED") + 5%" \
         "(MOMENTS=bf16 needs 4 B/param less)" >&2
    exit 2
fi

[[ "${DRY_RUN:-0}" == 1 ]] && { echo "DRY_RUN=1: checks passed, nothing run"; exit 0; }

if [[ "${SKIP_PLAIN:-0}" != 1 ]]; then
    echo "== plain PyTorch, log: $OUT/plain.log"
    set +e
    /usr/bin/time -v "$PY" "$HERE/plain_pytorch_oom.py" --size "$SIZE" --seq "$SEQ" --batch "$BATCH" \
        --steps 1 --json "$OUT/plain.json" > "$OUT/plain.log" 2>&1
    rc=$?
    set -e
    grep -v $'^\t' "$OUT/plain.log" || true  # /usr/bin/time's lines start with a tab
    echo "   exit status $rc (3 = out of memory, reported)"
fi

echo "== offload, log: $OUT/offload.log"
/usr/bin/time -v "$PY" "$HERE/train_gpt.py" --size "$SIZE" --precision bf16 --init-on-meta \
    --param-tier nvme --optimizer-tier nvme --nvme-path "$NVME" --pinned-budget "$PINNED" \
    --moments "$MOMENTS" --batch "$BATCH" --seq "$SEQ" --steps "$STEPS" --device cpu --clip "$CLIP" \
    --rss-budget "$RSS_BUDGET" "${RAM_FLAGS[@]}" --json "$OUT/offload.json" > "$OUT/offload.log" 2>&1
grep -vE $'^(done:|\t)' "$OUT/offload.log" || true
grep -E "Maximum resident|Elapsed" "$OUT/offload.log"
echo "swap directory after close(): $(du -sh "$NVME" | cut -f1)"
