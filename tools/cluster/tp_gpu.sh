#!/usr/bin/env bash
# kvtier serve under mlx.launch --backend nccl: tensor parallel over the 2 GPUs of one
# host (issue "Multi-GPU runs", item 2). Prepared on the CPU machine; not run there.
#
# From the repository root on the 2-GPU machine, with kvtier's dependencies and
# MLX's CUDA build installed (../shared/gpu/README.md; tools/bench/gpu_serving.sh
# prepares the same wheels):
#
#   bash tools/cluster/tp_gpu.sh MODEL_DIR [OUT_DIR] [extra kvtier serve flags...]
#
# MODEL_DIR: an mlx-lm model directory whose attention heads, KV heads and MLP
# width divide by 2 (kvtier refuses others at startup: NotShardable). What it
# does: starts 2 ranks (rank r on GPU r) serving on 127.0.0.1:$PORT, waits for
# ready, runs greedy requests and reports decode tok/s and TTFT at 1 stream
# (tools/cluster/tp_probe.py), then SIGTERMs rank 0, which drains and releases rank 1; logs in OUT_DIR.
#
# NOTE: NCCL_NVLS_ENABLE=0 (NVLink multicast off, as the device rules require)
# is exported here, so the ranks mlx.launch starts on this host inherit it,
# and passed with --env as well, for launches that reach other hosts.
set -euo pipefail

MODEL=${1:?usage: tp_gpu.sh MODEL_DIR [OUT_DIR] [serve flags...]}
OUT=${2:-${OUT:-/tmp/kvtier-tp}}
shift $(( $# >= 2 ? 2 : 1 ))
PORT=${PORT:-8431}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

export NCCL_NVLS_ENABLE=0
LAUNCH=("$PY" -m mlx._distributed_utils.launch)
command -v mlx.launch >/dev/null && LAUNCH=(mlx.launch)

set -x
setsid "${LAUNCH[@]}" --hosts 127.0.0.1 -n 2 --backend nccl --nccl-port "${NCCL_PORT:-12345}" \
  --env NCCL_NVLS_ENABLE=0 -- \
  "$PY" -m actors.cli serve --tensor-parallel on --model "$MODEL" \
  --host 127.0.0.1 --port "$PORT" --ssd-cache off "$@" \
  >"$OUT/launch.stdout" 2>"$OUT/launch.stderr" &
LAUNCHER=$!
set +x

for _ in $(seq 600); do
  grep -q "kvtier: ready" "$OUT/launch.stdout" && break
  kill -0 "$LAUNCHER" 2>/dev/null || { tail -50 "$OUT/launch.stderr"; exit 1; }
  sleep 1
done

"$PY" tools/cluster/tp_probe.py "http://127.0.0.1:$PORT" 3 256 | tee "$OUT/tp_probe.txt"

RANK0=$(grep -o "Started server process \[[0-9]*\]" "$OUT/launch.stderr" | grep -o "[0-9]*" | head -1)
kill -TERM "$RANK0"
wait "$LAUNCHER"
grep -q tp.follower_stopped "$OUT/launch.stderr" && echo "rank 1 released by rank 0: ok"
