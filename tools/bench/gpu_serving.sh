#!/usr/bin/env bash
# The serving benchmark (tools/bench/serving.py) on the lent H200: kvtier serve
# vs mlx_lm.server on one seeded random-weight Llama-3-8B-shaped bf16 model
# written to disk there, driven by guidellm, plus the agent-conversation trace.
#
# Three steps, from the repository root (../shared/gpu/README.md is the recipe):
#
#   1. here, once:      bash tools/bench/gpu_serving.sh prepare
#      (wheels for the device's Python 3.12 into .gpu/a and .gpu/b via
#       ../shared/gpu/prepare-wheels.sh: MLX CUDA, mlx-lm, what kvtier serve
#       imports that the device image lacks, and guidellm with the
#       dependencies the image lacks (torch, transformers, pandas, pyarrow are
#       there); the default model's tokenizer files into .gpu/tok.
#       NOTE: prepare-wheels.sh empties .gpu first.)
#   2. device call 1, carry [".gpu/a"], timeout_s 300, then at once call 1b,
#      carry [".gpu/c"] (the call's 64 MiB holds the working tree too):
#        bash tools/bench/gpu_serving.sh stash
#   3. device call 2 at once (the machine goes back after ~30 s idle),
#      carry [".gpu/b", ".gpu/tok"], timeout_s 600:
#        bash tools/bench/gpu_serving.sh run
#      NOTE: when the working tree and .gpu/b pass 64 MiB together (the
#      device refuses the call), stash .gpu/b first (call 1c, carry
#      [".gpu/b"]: `stash`) and carry [".gpu/tok"] alone here.
#      NOTE: once the working tree passes ~21 MB, even one wheel part and the
#      tree pass 64 MiB: split each part in two halves (`split -b 22500000 -d
#      -a 1 PART PART.`; .gpu/a keeps *.part-aa.0, .gpu/a2 gets *.part-aa.1;
#      .gpu/b keeps *.part-ab.0 and install-on-device.sh, .gpu/b2 gets
#      *.part-ab.1) and stash a, a2, c, b, b2 in five calls: `stash` joins
#      the halves on the machine.
#      Later calls on the same warm machine (same carry) skip the install and
#      the model write: `bash tools/bench/gpu_serving.sh run` again is one
#      more round; extra arguments go to serving.py (they override the
#      defaults below), e.g. `bash tools/bench/gpu_serving.sh run --rows 32`.
#
# What comes back in $OUT: serving.txt (the printout), serving.json (every
# figure, versions, commit, machine, kvtier's /stats tiers after the loads
# and after the agent trace), serving.png, logs.tgz (guidellm's JSON
# reports, the servers' logs).
#
# Other subcommands (same carry as `run`; each says more where it is defined):
#   profile      py-spy over kvtier serve at ${CONC:-32} streams
#   ssdprofile   py-spy over kvtier serve while requests decode behind write-behind
#   ssdline      the SSD line: ${PAIRS:-3} pairs of servers, tier on / off, order alternating
#   ssdvariants  SSD tier off / on / write-behind off / diagnostic switches
#   steps        the same closed loop served and in process (served_steps.py)
#   joins        where a batch step's time goes (join_cost.py)
#   attention    the batch lane's masked decode attention: MLX's fallback vs folded products
#   agent        the agent line: ragged suffixes aligned vs padded, buffer cache kept vs emptied, then served
#   loadab       the 8- and 32-stream lines served, kvtier alone, with and without AB_ENV
#   mailwaits    time in each actor's mailbox and handler at 32 streams (mailbox_waits.py)
#   agentab      the agent line served, kvtier alone, with and without AB_ENV (default: no periodic cache emptying)
#   agentmx      the same with several variants in one call (MX_VARIANTS: NAME[:KEY=VALUE ...]|...)
#   runab        the whole served line with and without AB_ENV, the peer once a call (three calls: three runs each;
#                AB_STEP=full, then AB_STEP=alone: the two halves in two calls)
#   lonejoin     a lone row joining over a cached 5,100-token prefix, in process (vs 8 rows)
#   shapes       a new query length's cost op by op: matmul, forward, forward over a cached 5,100 (shape_costs.py)
#   newshapes    the same joins with no shape repeated, prefill folding on / off, beside 0 / 4 decoding rows
#   extras       SSD on/off TTFT; checkpoint restart at 75 % (EXTRAS=ssd: the first only)
#   ckpt         checkpoints' decode cost: off / whole read-backs / deltas side by side (checkpoint.py)
#   readback     a checkpoint read-back's pieces on CUDA: gather, first host view, host read (cuda_readback.py)
#   sdpa         prefill attention per step when every shape is new: cuDNN's graph builds (sdpa_shapes.py)
#   stepparts    where a decode step's time goes at 1 / 8 / 32 rows (decode_step_parts.py)
#   fewrow       the CUDA few-row product: numbers, speed, a decode step with it (cuda_few_row.py)
#   looptrace    the event loop's busy iterations, callback by callback, at 8 and 32 streams (loop_trace.py)
#   memguard     the memory guard beside another process holding the card's memory (cuda_memory_guard.py)
#   ttft         in-process TTFT/decode, Engine vs stream_generate (gpu_engine.py;
#                --variants ROWS:STEP, TTFT_CACHE=1 --cache-rows --cache-burst)
#   cluster      issue 24's CPU lines on the device's 16 cores: replicas behind
#                sglang-router / the event router (cluster.py, --device cpu);
#                needs `prepare-cluster` here and one more stash call (.gpu/d)
set -euo pipefail

PINS=(
  # kvtier serve (the image has anyio's deps, aiofiles, numpy, transformers, xxhash,
  # prometheus-client, httpx, h11; llguidance is imported only for structured output)
  structlog==26.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 anyio==4.16.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 annotated-doc==0.0.7
  # guidellm and what it imports that the image lacks (torch, transformers,
  # pandas, pyarrow, msgpack, uvloop, rich, huggingface-hub are there)
  guidellm==0.8.1 click==8.4.2 Faker==40.63.0 aiologic==0.17.1 culsans==0.10.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 ftfy==6.3.1 wcwidth==0.9.4
  h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 loguru==0.7.3 more-itertools==11.2.1
  pydantic-settings==2.16.3 python-dotenv==1.2.4 websockets==17.4 eval-type-backport==0.4.0
  sniffio==1.3.1 opentelemetry-api==1.45.2
  # the sampling profiler of `profile`
  py-spy==0.4.3
)
# NOTE: issue 24's router and KV-event plane, for `cluster` (prepare-cluster puts
# them in .gpu/d: the router's wheel alone is 31 MB); the image has aiohttp,
# fastapi comes with PINS, msgpack is there.
CLUSTER_PINS=(sglang-router==0.3.2 orjson==3.11.4 setproctitle==1.3.7 pyzmq==27.3.0 msgspec==0.23.0)
MODEL=${KVTIER_GPU_MODEL:-/tmp/kvtier-gpu/llama3-8b}
SITE=${SITE:-$HOME/kvtier-gpu/site}
WORK=${KVTIER_GPU_WORK:-/tmp/kvtier-gpu/serving}
TOK_SRC=${KVTIER_TOK_SRC:-${KVTIER_HOME:-$HOME/.cache/kvtier}/models/SmolLM2-135M-Instruct-fp32}
# NOTE: issue 20's loads: ~530-token prompts, 128 new tokens, 1 / 8 / 32 / 64
# streams, a constant rate at 80 % of mlx_lm.server's saturation, 8
# conversations x 4 turns over a ~4.4k-token system prompt. About 5-7 minutes
# for both servers after the install (~30 s) and the model write (~1-2 min).
DEFAULTS=(
  --concurrency 1,8,32,64 --requests-per-stream 2 --min-requests 4
  --prompt-tokens 512 --max-tokens 128
  --rate-fractions 0.8 --rate-seconds 30
  --agent 8x4 --system-tokens 4400 --agent-max-tokens 32
)

# NOTE: the install and the environment every device command shares (the
# install runs once per machine; later calls on a warm machine skip it).
device_env() {
  if [ ! -f "$SITE/.kvtier-installed" ]; then
    # NOTE: .gpu/b this call or, when the working tree left no room for it,
    # the copy an earlier `stash` call made.
    b=.gpu/b
    # NOTE: by its whole wheel part, not the folder: an earlier call's
    # .gpu/b stays on the machine, and may hold only a half of it.
    if ! compgen -G "$b/*.part-ab" > /dev/null; then b=$HOME/kvtier-gpu/stash-b; fi
    for w in "$b"/*.whl; do if [ -f "$w" ]; then cp "$w" "$HOME/kvtier-gpu/stash/"; fi; done
    SITE=$SITE bash "$b/install-on-device.sh" "$b"
    touch "$SITE/.kvtier-installed"
  fi
  export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
  KVTIER_COMMIT=$(cat .gpu/tok/commit 2>/dev/null || echo unknown)
  export KVTIER_COMMIT
}

# NOTE: AB_ENV's assignments (split on spaces; default: no periodic cache
# emptying) as serving.py arguments, one per line: --kvtier-env, then the
# assignment, each for kvtier's process only (recorded in the run's JSON).
# %RUN% in an assignment becomes $1 (agentab's run number).
ab_env_args() {
  local assigns a
  read -r -a assigns <<< "${AB_ENV:-KVTIER_BATCH_CLEAR_EVERY=0}"
  for a in "${assigns[@]}"; do printf '%s\n%s\n' --kvtier-env "${a//%RUN%/${1:-}}"; done
}

# NOTE: .gpu/tok/base.tgz (a `git archive` of an earlier commit: actors
# kernels messages) unpacked to /tmp/base, the baseline tree of memguard,
# mailwaits and the AB_BASE=1 runs.
unpack_base() {
  rm -rf /tmp/base && mkdir -p /tmp/base && tar -xzf .gpu/tok/base.tgz -C /tmp/base
}

# NOTE: loadab's and agentab's runs: the order A B B A A B ... (the first
# run's server warms up with MLX's first compiles), no new run once
# AB_BUDGET_S (default 480) seconds have passed. For each run it sets $v (off /
# on), $i (the run's index), $n (the machine's next round: fresh prompts) and
# envs (the "on" runs' AB_ENV as --kvtier-env arguments; with AB_BASE=1 the
# "off" runs' PYTHONPATH with the tree of .gpu/tok/base.tgz first instead),
# then calls "$@" and prints the run's seconds.
ab_runs() {
  local start=$SECONDS t0
  if [ "${AB_BASE:-0}" = 1 ]; then
    unpack_base
  fi
  i=0
  for v in off on on off off on on off; do
    if [ $((SECONDS - start)) -ge "${AB_BUDGET_S:-480}" ]; then break; fi
    n=$(cat "$WORK/calls" 2>/dev/null || echo 0)
    echo $((n + 1)) > "$WORK/calls"
    envs=()
    if [ "${AB_BASE:-0}" = 1 ]; then
      if [ "$v" = off ]; then envs=(--kvtier-env "PYTHONPATH=/tmp/base:$PYTHONPATH"); fi
    elif [ "$v" = on ]; then
      mapfile -t envs < <(ab_env_args "$i")
    fi
    t0=$SECONDS
    "$@"
    echo "run $i $v: $((SECONDS - t0)) s"
    # NOTE: the run's SSD tiers go with it (as `run`'s do), so every run meets the same disk.
    rm -rf "$WORK/call-$n"/kv-*
    i=$((i + 1))
  done
}

# NOTE: agentab's and agentmx's run: kvtier alone on the agent trace (8
# conversations x 4 turns over a 4,400-token system prompt), a fresh server
# and fresh prompts, as run $i of variant $v with envs (ab_runs' variables);
# its agent lines printed. stdin from /dev/null: agentmx's loop reads its
# plan on its stdin.
agent_run() {
  python3 tools/bench/serving.py "${envs[@]}" --random-model "${KVTIER_GPU_SHAPE:-llama3-8b}" \
    --tok-dir .gpu/tok --model "$MODEL" --out "$WORK/call-$n" --first-round "$n" --servers kvtier \
    --json "$OUT/ab/run$i-$v.json" --title "agent $v" --skip-loadgen --agent 8x4 \
    --system-tokens 4400 --agent-max-tokens 32 "$@" < /dev/null 2>&1 \
    | grep -E "agent|start-up warm-up|kvtier  code:" | sed "s/^/run $i $v: /"
}

# NOTE: the 8B directory `run` writes, for the commands that do not run serving.py.
ensure_model() {
  if [ ! -f "$MODEL/config.json" ]; then
    python3 -c 'import sys; sys.path.insert(0, "tools/bench"); from pathlib import Path
from serving import write_random_model
write_random_model(Path(sys.argv[1]), sys.argv[2], Path(".gpu/tok"), 0)' "$MODEL" "${KVTIER_GPU_SHAPE:-llama3-8b}"
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  prepare)
    bash "${KVTIER_SHARED:-../shared}/gpu/prepare-wheels.sh" "${PINS[@]}"
    mkdir -p .gpu/tok
    for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do
      cp "$TOK_SRC/$f" .gpu/tok/
    done
    # NOTE: the device takes at most 64 MiB a call, the working tree included
    # (~21 MiB with the benchmark data): .gpu/a keeps only the first part of
    # MLX's CUDA wheel (45 MB); every other wheel goes in a call of its own
    # (.gpu/c, stashed like .gpu/a).
    mkdir -p .gpu/c
    for f in .gpu/a/*; do
      case "$f" in *.part-aa) ;; *) mv "$f" .gpu/c/ ;; esac
    done
    # NOTE: the device gets the working tree without .git: name the code here.
    echo "$(git rev-parse --short HEAD)+$(git status --porcelain | wc -l)-changed" > .gpu/tok/commit
    du -sh .gpu/a .gpu/b .gpu/c .gpu/tok
    ;;
  prepare-cluster)
    # Here, after `prepare`: what `cluster` needs beyond `run`'s install, into
    # .gpu/d and .gpu/d2 (~37 MB: stash each in a call of its own, carry
    # [".gpu/d"] then [".gpu/d2"], before the call that installs): sglang-router and its imports, pyzmq and
    # msgspec (the KV events), and Debian's pthread OpenBLAS with its Fortran
    # runtime (MLX's CPU backend bundles the reference BLAS; the Makefile
    # preloads OpenBLAS here for the same ~20x).
    rm -rf .gpu/d && mkdir -p .gpu/d
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .gpu/d "${CLUSTER_PINS[@]}"
    ob=$(mktemp -d)
    cp -L /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
      /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
      /lib/x86_64-linux-gnu/libgfortran.so.5 /lib/x86_64-linux-gnu/libquadmath.so.0 "$ob"/
    tar -cJf .gpu/d/openblas.tar.xz -C "$ob" .
    rm -rf "$ob"
    # NOTE: sglang-router's wheel (31 MB) alone in .gpu/d, the rest in
    # .gpu/d2: with the working tree past 27 MiB the two together passed one
    # call's 64 MiB. Stash each in a call of its own. NOTE: the tree (35.2 MB
    # tracked at 0bf988c) and the router's wheel (30.7 MB) come within ~1.2 MB
    # of 64 MiB: past that, split the wheel in halves as .gpu/a's part is.
    rm -rf .gpu/d2 && mkdir -p .gpu/d2
    for f in .gpu/d/*; do case "$f" in *sglang_router*) ;; *) mv "$f" .gpu/d2/ ;; esac; done
    du -sh .gpu/d .gpu/d2
    ;;
  stash)
    # NOTE: whichever of .gpu/a, .gpu/b, .gpu/c, .gpu/d and .gpu/d2 this call carried.
    # .gpu/b keeps its own folder: the install joins its wheel part there.
    mkdir -p ~/kvtier-gpu/stash ~/kvtier-gpu/stash-b
    # NOTE: .gpu/a may come in two halves (.gpu/a: *.part-aa.0, .gpu/a2:
    # *.part-aa.1), when the working tree and the whole part pass one call's
    # 64 MiB; the half that arrives second joins them.
    for d in .gpu/a .gpu/a2 .gpu/c .gpu/d .gpu/d2; do if [ -d "$d" ]; then cp "$d"/* ~/kvtier-gpu/stash/; fi; done
    for d in .gpu/b .gpu/b2; do if [ -d "$d" ]; then cp -p "$d"/* ~/kvtier-gpu/stash-b/; fi; done
    for half in ~/kvtier-gpu/stash/*.part-aa.0 ~/kvtier-gpu/stash-b/*.part-ab.0; do
      if [ -f "$half" ] && [ -f "${half%.0}.1" ]; then
        cat "$half" "${half%.0}.1" > "${half%.0}" && rm "$half" "${half%.0}.1"
      fi
    done
    ls ~/kvtier-gpu/stash ~/kvtier-gpu/stash-b | wc -l
    ;;
  run)
    device_env
    # NOTE: every call on the same machine is the next round: fresh prompts
    # (seeded by the round), fresh SSD-tier directories, the order alternating.
    mkdir -p "$WORK"
    n=$(cat "$WORK/calls" 2>/dev/null || echo 0)
    echo $((n + 1)) > "$WORK/calls"
    run_dir=$WORK/call-$n
    mkdir -p "$run_dir"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    # NOTE: two switches for the per-server decode speed (a call's first
    # server decoded a lone row at 8.3 ms a token, later ones at 12.6-13.4:
    # docs/benchmarks.md, 2026-12-07 06:55). RUN_CLEAN=1: the earlier calls'
    # SSD-tier files removed and the page cache dropped before this call;
    # RUN_PTX=fresh: this call's servers compile MLX's kernels into a folder
    # of their own (MLX_PTX_CACHE_DIR) instead of reusing earlier ones'.
    if [ -n "${RUN_CLEAN:-}" ]; then
      rm -rf "$WORK"/call-*/kv-*
      sync && { echo 3 > /proc/sys/vm/drop_caches; } 2> /dev/null || echo "page cache not dropped (not root)"
      grep -E "MemFree|^Cached" /proc/meminfo
    fi
    if [ "${RUN_PTX:-}" = fresh ]; then
      export MLX_PTX_CACHE_DIR=$run_dir/ptx
      mkdir -p "$MLX_PTX_CACHE_DIR"
    fi
    rc=0
    python3 tools/bench/serving.py --random-model "${KVTIER_GPU_SHAPE:-llama3-8b}" --tok-dir .gpu/tok --model "$MODEL" \
      --guidellm-python "$(command -v python3)" --out "$run_dir" --first-round "$n" \
      --json "$OUT/serving.json" --plot "$OUT/serving.png" --title "H200" \
      "${DEFAULTS[@]}" "$@" 2>&1 | tee "$OUT/serving.txt" || rc=$?
    # NOTE: not the SSD tiers' directories (GBs of KV files), nor the kernels.
    tar -czf "$OUT/logs.tgz" --exclude="./kv-*" --exclude="./ptx" -C "$run_dir" . || true
    # NOTE: nor kept: a run's tiers wrote ~12 GB on the 64 GB disk, so calls
    # that kept them left the next call's servers a smaller SSD cap (a quarter
    # of the free space) and a fuller disk (14 GiB free by the fifth call).
    rm -rf "$run_dir"/kv-*
    exit $rc
    ;;
  profile)
    # kvtier alone at ${CONC:-32} streams (the model `run` wrote) while py-spy
    # samples the server's threads for ${PROFILE_SECONDS:-15} s once guidellm has
    # run ${PROFILE_DELAY:-12} s: where the served path's time goes.
    # Writes profile.txt, pyspy-raw.txt (collapsed stacks per thread),
    # pyspy-dump.txt and the server log.
    device_env
    spy=$(find "$SITE" -name py-spy -type f | head -1)
    mkdir -p "$WORK/profile"
    python3 tools/bench/serving.py --servers kvtier --model "$MODEL" --guidellm-python "$(command -v python3)" \
      --out "$WORK/profile" --first-round 90 --concurrency "${CONC:-32}" --requests-per-stream 4 \
      --prompt-tokens 512 --max-tokens 128 --rate-fractions '' --agent '' \
      --kvtier-arg=--log-format --kvtier-arg=json "$@" > "$OUT/profile.txt" 2>&1 &
    bg=$!
    # NOTE: "--scenario" is on guidellm's command line only (serving.py's
    # own names --guidellm-python); guidellm needs ~10 s to start its load.
    for _ in $(seq 1 600); do pgrep -f -- "--scenario" > /dev/null && break; sleep 0.5; done
    sleep "${PROFILE_DELAY:-12}"
    pid=$(pgrep -f "actors.cli serve" | head -1 || true)
    if [ -n "$pid" ] && [ -n "$spy" ]; then
      "$spy" record --pid "$pid" --duration "${PROFILE_SECONDS:-15}" --rate 200 --threads \
        --format raw -o "$OUT/pyspy-raw.txt" > "$OUT/pyspy.log" 2>&1 || true
      "$spy" dump --pid "$pid" > "$OUT/pyspy-dump.txt" 2>&1 || true
    else
      echo "no server ($pid) or no py-spy ($spy)" > "$OUT/pyspy.log"
    fi
    wait $bg || true
    tail -n 30 "$OUT/profile.txt"
    grep -rh --exclude-dir="kv-*" -e request.timeline -e background_step "$WORK/profile" \
      | tail -n 600 > "$OUT/timeline.txt" || true
    tar -czf "$OUT/profile-logs.tgz" --exclude="./kv-*" -C "$WORK/profile" . || true
    ;;
  steps)
    # The same closed loop (${ROWS:-32} clients, each sending requests one after
    # the other, 512-token prompts, 128 new tokens) through `kvtier serve`
    # (--ssd-cache off) and through the in-process Engine, on the model `run`
    # wrote: what the served path leaves of the engine's throughput.
    # NOTE: on an H100 add --in-turn at 32 rows: the server and the in-process
    # Engine alive at once overfill its 80 GB (the Engine's first 32-row step
    # failed out of memory beside the warmed server; docs/benchmarks.md,
    # 2026-12-06 17:24), e.g. ROWS=32 gpu_serving.sh steps --in-turn
    device_env
    ensure_model
    python3 tools/bench/served_steps.py --model "$MODEL" --tok-dir .gpu/tok --rows "${ROWS:-32}" \
      --requests 3 --prompt-tokens 512 --max-tokens 128 --rounds "${ROUNDS:-3}" \
      --json "$OUT/steps.json" "$@" 2>&1 | tee "$OUT/steps.txt"
    ;;
  joins)
    # Where a batch step's time goes when rows join and leave (join_cost.py:
    # the same closed loop on BatchGeneration, each phase timed with the
    # device synchronized), on the model `run` or `steps` wrote.
    device_env
    ensure_model
    python3 tools/bench/join_cost.py --model "$MODEL" --tok-dir .gpu/tok --rows "${ROWS:-32}" \
      --json "$OUT/join_cost.json" "$@" 2>&1 | tee "$OUT/join_cost.txt"
    ;;
  attention)
    # The batch lane's masked decode attention, MLX's fallback vs kvtier's
    # folded products (kernels/model/_masked_attention.py): the operation
    # alone (masked_attention.py), then on the 8B shape a burst of 8 rows
    # over a cached 5,100-token prefix and the 32-row closed loop, each with
    # the folded path on and off, interleaved (join_cost.py --attention on,off).
    device_env
    ensure_model
    python3 tools/bench/masked_attention.py --json "$OUT/masked_attention.json" --plot "$OUT/masked_attention.png" 2>&1 | tee "$OUT/masked_attention.txt"
    python3 tools/bench/join_cost.py --model "$MODEL" --tok-dir .gpu/tok --burst 8 --prefix-tokens 5100 \
      --suffix-tokens 56 --max-tokens 32 --prompt-tokens 530 --prefill-step-size 2048 --rounds 3 \
      --background 0,8 --attention on,off,kernel --json "$OUT/burst.json" 2>&1 | tee "$OUT/burst.txt"
    # NOTE: as served, the agent's suffixes differ in length (24-56 tokens):
    # the group is right-padded and its caches rolled after the forward
    # (the `roll` phase).
    python3 tools/bench/join_cost.py --model "$MODEL" --tok-dir .gpu/tok --burst 8 --prefix-tokens 5100 \
      --suffix-tokens 40 --suffix-spread 0.4 --max-tokens 32 --prompt-tokens 530 --prefill-step-size 2048 \
      --rounds 3 --background 0,8 --attention on --json "$OUT/burst-spread.json" 2>&1 | tee "$OUT/burst-spread.txt"
    python3 tools/bench/join_cost.py --model "$MODEL" --tok-dir .gpu/tok --rows 32 --requests 2 \
      --prompt-tokens 512 --max-tokens 128 --prefill-step-size 2048 --stagger 0.25 --rounds 3 \
      --attention on,off,kernel --no-sync --json "$OUT/loop.json" "$@" 2>&1 | tee "$OUT/loop.txt"
    ;;
  agent)
    # Issue 20's agent line, split: in process, 8 rows over a cached 5,100-token
    # prefix with suffixes of different lengths (as served): the group's
    # suffixes aligned (default) vs padded and rolled (KVTIER_BATCH_ALIGN_SUFFIXES=0),
    # and MLX's buffer cache kept across prefill forwards (default) vs emptied
    # after each (KVTIER_BATCH_PREFILL_CLEAR=1, mlx-lm's way), interleaved; then
    # served, both servers, the agent trace only (an agent warm-up of the same
    # shape first), each kvtier turn with its server-side phases and the batch
    # step it joined in; then kvtier alone with the buffer cache emptied.
    device_env
    ensure_model
    for r in 1 2 3; do
      for v in "1 0" "0 0" "1 1"; do
        set -- $v
        KVTIER_BATCH_ALIGN_SUFFIXES=$1 KVTIER_BATCH_PREFILL_CLEAR=$2 python3 tools/bench/join_cost.py \
          --model "$MODEL" --tok-dir .gpu/tok --burst 8 --prefix-tokens 5100 --suffix-tokens 40 \
          --suffix-spread 0.4 --max-tokens 32 --prompt-tokens 530 --prefill-step-size 2048 --rounds 1 \
          --background 0,8 --attention on --json "$OUT/burst-align$1-clear$2-r$r.json" 2>&1 \
          | grep -E "synchronized|phases" | sed "s/^/align=$1 clear=$2 /"
      done
    done | tee "$OUT/burst-align.txt"
    # NOTE: one archive: the device call brings back only a few files.
    tar czf "$OUT/burst-align.tgz" -C "$OUT" $(cd "$OUT" && ls burst-align*-r*.json) && rm -f "$OUT"/burst-align*-r*.json
    mkdir -p "$WORK"
    for variant in kept clear; do
      n=$(cat "$WORK/calls" 2>/dev/null || echo 0)
      echo $((n + 1)) > "$WORK/calls"
      servers=mlx_lm,kvtier
      clear=0
      if [ "$variant" = clear ]; then servers=kvtier; clear=1; fi
      KVTIER_BATCH_PREFILL_CLEAR=$clear python3 tools/bench/serving.py --random-model "${KVTIER_GPU_SHAPE:-llama3-8b}" \
        --tok-dir .gpu/tok --model "$MODEL" --out "$WORK/call-$n" --first-round "$n" --servers "$servers" \
        --json "$OUT/agent-$variant.json" --title "H200 agent" --skip-loadgen --agent 8x4 \
        --system-tokens 4400 --agent-max-tokens 32 2>&1 | tee "$OUT/agent-$variant.txt" | grep -E "agent"
    done
    ;;
  runab)
    # Issue 20's served line with and without one environment switch for
    # kvtier (AB_ENV, as agentab), the peer run once: both servers with one
    # variant (the `run` defaults), then kvtier alone with the other over the
    # same round's prompts and the same constant rate. Which variant runs
    # with the peer alternates by call (even calls: the default). Three calls
    # give three runs of each; serving_runs.py pairs them:
    #   serving_runs.py full-A.json kvtier-B.json+full-A.json ...
    # Writes full-<variant>.json, kvtier-<variant>.json, runab.txt, logs.tgz.
    # NOTE: both halves take ~11 minutes on an H100 when the peer's constant
    # rate degrades (the full run ~7, kvtier alone ~4): more than one call's
    # 600 s. AB_STEP=full runs the first half (and keeps what the second
    # needs in $WORK), then a call with AB_STEP=alone the second; unset, one
    # call runs both. serving.py's JSON keeps every phase finished before a
    # call's limit ("complete": false).
    device_env
    mkdir -p "$WORK"
    step=${AB_STEP:-both}
    rc=0
    if [ "$step" != alone ]; then
      n=$(cat "$WORK/calls" 2>/dev/null || echo 0)
      echo $((n + 1)) > "$WORK/calls"
      if [ $((n % 2)) -eq 0 ]; then full=default; alone=switched; else full=switched; alone=default; fi
      echo "call $n: $full with the peer, then $alone alone; switched = ${AB_ENV:-KVTIER_BATCH_CLEAR_EVERY=0}" | tee "$OUT/runab.txt"
      full_env=()
      if [ "$full" = switched ]; then mapfile -t full_env < <(ab_env_args); fi
      python3 tools/bench/serving.py --random-model "${KVTIER_GPU_SHAPE:-llama3-8b}" --tok-dir .gpu/tok \
        --model "$MODEL" --guidellm-python "$(command -v python3)" --out "$WORK/call-$n" --first-round "$n" \
        --json "$OUT/full-$full.json" --title "H200 $full" "${DEFAULTS[@]}" "${full_env[@]}" "$@" 2>&1 \
        | tee -a "$OUT/runab.txt" || rc=$?
      cp "$OUT/full-$full.json" "$WORK/runab-full.json" 2>/dev/null || true
      echo "$n $full $alone" > "$WORK/runab-pending"
    else
      read -r n full alone < "$WORK/runab-pending"
      echo "call $n, second half: $alone alone (the full run was $full); switched = ${AB_ENV:-KVTIER_BATCH_CLEAR_EVERY=0}" | tee "$OUT/runab.txt"
      cp "$WORK/runab-full.json" "$OUT/full-$full.json"
    fi
    if [ "$step" != full ]; then
      alone_env=()
      if [ "$alone" = switched ]; then mapfile -t alone_env < <(ab_env_args); fi
      rate=$(python3 -c 'import json, sys; print(",".join(str(r) for r in json.load(open(sys.argv[1]))["constant_rates"]))' \
        "$OUT/full-$full.json" 2>/dev/null || echo "")
      # NOTE: the same round (prompts) and the peer's constant rate, a fresh
      # directory (so a fresh SSD tier), kvtier alone.
      python3 tools/bench/serving.py --model "$MODEL" --guidellm-python "$(command -v python3)" \
        --out "$WORK/call-$n-alone" --first-round "$n" --servers kvtier --json "$OUT/kvtier-$alone.json" \
        --title "H200 $alone" "${DEFAULTS[@]}" --rate "$rate" "${alone_env[@]}" "$@" 2>&1 \
        | tee -a "$OUT/runab.txt" || rc=$?
      python3 tools/bench/serving_runs.py "$OUT/full-$full.json" "$OUT/kvtier-$alone.json+$OUT/full-$full.json" \
        --label "$full" --label "$alone" 2>&1 | tee -a "$OUT/runab.txt" || true
    fi
    # NOTE: not the SSD tiers' directories (kv-*, GBs), in either call directory.
    dirs=()
    for d in "call-$n" "call-$n-alone"; do if [ -d "$WORK/$d" ]; then dirs+=("$d"); fi; done
    if [ ${#dirs[@]} -gt 0 ]; then tar -czf "$OUT/logs.tgz" --exclude="kv-*" -C "$WORK" "${dirs[@]}" || true; fi
    for d in "${dirs[@]}"; do rm -rf "$WORK/$d"/kv-*; done
    exit $rc
    ;;
  loadab)
    # Issue 20's closed-loop lines, kvtier alone, with and without one
    # environment assignment (AB_ENV): guidellm at ${AB_LEVELS:-8,32} streams,
    # ${AB_PER_STREAM:-4} requests a stream of 512-token prompts and 128 new
    # tokens, a fresh server and fresh prompts each run, the order A B B A A
    # B ..., no new run once AB_BUDGET_S (default 480) seconds have passed.
    # E.g. the idle wave in two forwards (16 rows, then 4 a turn):
    #   AB_ENV="KVTIER_PREFILL_STEP_SIZE=1024 KVTIER_PREFILL_BUDGET=2048"
    # AB_BASE=1 makes "off" the code of .gpu/tok/base.tgz (a `git archive` of
    # an earlier commit: actors kernels messages) instead: its tree, unpacked
    # to /tmp/base, goes first on the off runs' PYTHONPATH (AB_ENV then
    # applies to neither), e.g. one runtime change against the commit before:
    #   AB_BASE=1 AB_LEVELS=32 AB_PER_STREAM=2 gpu_serving.sh loadab
    # The SSD tier's part in the 8-stream step that slowed call by call on
    # one host (docs/benchmarks.md, 2026-12-07 14:23): "on" runs without the
    # tier, each run prints the page cache and the GPU's clocks around it:
    #   AB_ENV=KVTIER_SSD_CACHE=off AB_LEVELS=8 AB_PER_STREAM=3 gpu_serving.sh loadab
    # loadab.txt has each run's level lines and phases; loadab.tgz every run's
    # JSON (serving_runs.py pairs them).
    device_env
    ensure_model
    mkdir -p "$WORK" "$OUT/ab"
    loadab_one() {
      python3 tools/bench/serving.py "${envs[@]}" --model "$MODEL" --guidellm-python "$(command -v python3)" \
        --out "$WORK/call-$n" --first-round "$n" --servers kvtier --json "$OUT/ab/run$i-$v.json" \
        --concurrency "${AB_LEVELS:-8,32}" --requests-per-stream "${AB_PER_STREAM:-4}" --min-requests 4 \
        --prompt-tokens 512 --max-tokens 128 --rate-fractions '' --agent '' "$@" 2>&1 \
        | grep -E "streams (ok|phases|join)|kvtier  code:|kvtier  host (loop|before|after)" | sed "s/^/run $i $v: /"
    }
    ab_runs loadab_one "$@" | tee "$OUT/loadab.txt"
    tar czf "$OUT/loadab.tgz" -C "$OUT/ab" . && rm -rf "$OUT/ab"
    ;;
  mailwaits)
    # Where messages wait between actors: kvtier alone at ${MW_LEVELS:-32}
    # streams (${MW_PER_STREAM:-2} requests a stream: a level's first wave) with
    # per-message events in JSON logs, then mailbox_waits.py over its log (time
    # in each mailbox and each handler's time per actor and kind). NOTE: the
    # events cost time of their own; compare kinds within the run, not the
    # run's TTFT with another's. With AB_BASE=1 the tree of .gpu/tok/base.tgz
    # runs first, then this tree.
    device_env
    ensure_model
    mkdir -p "$WORK"
    trees=(this)
    if [ "${AB_BASE:-0}" = 1 ]; then
      unpack_base
      trees=(base this)
    fi
    for tree in "${trees[@]}"; do
      n=$(cat "$WORK/calls" 2>/dev/null || echo 0)
      echo $((n + 1)) > "$WORK/calls"
      envs=(--kvtier-env KVTIER_LOG_LEVEL=debug --kvtier-env KVTIER_LOG_FORMAT=json)
      if [ "$tree" = base ]; then envs+=(--kvtier-env "PYTHONPATH=/tmp/base:$PYTHONPATH"); fi
      python3 tools/bench/serving.py "${envs[@]}" --model "$MODEL" --guidellm-python "$(command -v python3)" \
        --out "$WORK/mail-$n" --first-round "$n" --servers kvtier --json "$OUT/mailwaits-$tree.json" \
        --concurrency "${MW_LEVELS:-32}" --requests-per-stream "${MW_PER_STREAM:-2}" --min-requests 4 \
        --prompt-tokens 512 --max-tokens 128 --rate-fractions '' --agent '' "$@" 2>&1 \
        | grep -E "streams (ok|phases)|kvtier  code:" | sed "s/^/$tree: /" | tee -a "$OUT/mailwaits.txt"
      python3 tools/bench/mailbox_waits.py "$WORK/mail-$n/kvtier-r$n.stderr" --json "$OUT/mailwaits-$tree-actors.json" \
        | sed "s/^/$tree: /" | tee -a "$OUT/mailwaits.txt"
    done
    ;;
  agentab)
    # Issue 20's agent line, kvtier alone, served, with and without one
    # environment assignment (AB_ENV, default KVTIER_BATCH_CLEAR_EVERY=0):
    # the agent trace only (8 conversations x 4 turns over a 4,400-token
    # system prompt), a fresh server and fresh prompts each run, the order
    # A B B A A B ... (the first run's server warms up with MLX's first
    # compiles), no new run once AB_BUDGET_S (default 480) seconds have passed.
    # agentab.txt has each run's agent lines and its server's start-up warm-up
    # line (steps, rows, seconds); agentab.tgz every run's JSON, which
    # tools/bench/agent_ab.py reads (each variant's median, spread, plot).
    # NOTE: %RUN% in AB_ENV becomes the run's number, e.g. a kernel cache
    # of its own per run, so every "on" run compiles from nothing:
    #   AB_ENV=MLX_PTX_CACHE_DIR=/tmp/kvtier-ptx-%RUN% gpu_serving.sh agentab
    device_env
    ensure_model
    mkdir -p "$WORK" "$OUT/ab"
    ab_runs agent_run "$@" | tee "$OUT/agentab.txt"
    tar czf "$OUT/agentab.tgz" -C "$OUT/ab" . && rm -rf "$OUT/ab"
    ;;
  agentmx)
    # agentab with more than two variants in one call (default: the defaults,
    # the suffix fold and its bucket off, MLX's CUDA graphs off): MX_VARIANTS, '|'-separated
    # NAME or NAME:ASSIGNMENTS (space-separated KEY=VALUE for kvtier's process;
    # %RUN% becomes the run's number), cycle c rotated by c (agent_ab.py
    # --schedule), no new run once AB_BUDGET_S (default 480) seconds have
    # passed; a run takes ~45 s on an H100. E.g. which switch of the pair
    # cuts the agent line, and kvtier's own routes beside MLX's graphs off:
    #   MX_VARIANTS="off|pair:MLX_CUDA_USE_CUDNN_SDPA=0 MLX_USE_CUDA_GRAPHS=0|graphs:MLX_USE_CUDA_GRAPHS=0|fold:KVTIER_CUDA_PREFILL_FOLD=on MLX_USE_CUDA_GRAPHS=0"
    # and kvtier's suffix fold, on by default on CUDA (graphs kept for decode):
    #   MX_VARIANTS="off|nofold:KVTIER_CUDA_SUFFIX_FOLD=off KVTIER_BATCH_PREFILL_BUCKET=0|sfng:MLX_USE_CUDA_GRAPHS=0"
    # agentmx.txt and agentmx.tgz as agentab's (runI-NAME.json), read by
    # tools/bench/agent_ab.py (each variant against --baseline off).
    device_env
    ensure_model
    mkdir -p "$WORK" "$OUT/ab"
    mx_start=$SECONDS
    python3 tools/bench/agent_ab.py --schedule "${MX_VARIANTS:-off|nofold:KVTIER_CUDA_SUFFIX_FOLD=off KVTIER_BATCH_PREFILL_BUCKET=0|sfng:MLX_USE_CUDA_GRAPHS=0}" \
      --cycles "${MX_CYCLES:-8}" > "$WORK/mx-plan.txt"
    while read -r i v assigns; do
      if [ $((SECONDS - mx_start)) -ge "${AB_BUDGET_S:-480}" ]; then break; fi
      n=$(cat "$WORK/calls" 2>/dev/null || echo 0)
      echo $((n + 1)) > "$WORK/calls"
      envs=()
      for a in $assigns; do envs+=(--kvtier-env "${a//%RUN%/$i}"); done
      t0=$SECONDS
      agent_run "$@"
      echo "run $i $v: $((SECONDS - t0)) s"
      # NOTE: the run's SSD tiers go with it, as ab_runs' do.
      rm -rf "$WORK/call-$n"/kv-*
    done < "$WORK/mx-plan.txt" | tee "$OUT/agentmx.txt"
    python3 tools/bench/agent_ab.py "$OUT/ab" --skip ab/run0-"$(head -1 "$WORK/mx-plan.txt" | cut -d' ' -f2)" \
      | tee -a "$OUT/agentmx.txt"
    tar czf "$OUT/agentmx.tgz" -C "$OUT/ab" . && rm -rf "$OUT/ab"
    ;;
  sdpa)
    # Prefill attention when every step's shape is new (sdpa_shapes.py): MLX's
    # fused path builds one cuDNN graph per exact shape; kvtier's folded
    # products beside it. No model needed.
    device_env
    python3 tools/bench/sdpa_shapes.py --json "$OUT/sdpa_shapes.json" "$@" 2>&1 | tee "$OUT/sdpa_shapes.txt"
    ;;
  readback)
    # Where the batch lane's ~9.4 ms checkpoint views turn goes: the one-buffer
    # copy, the first host view of it, the host read, idle and behind a
    # decode-sized matmul chain (no model needed).
    device_env
    python3 tools/bench/cuda_readback.py --json "$OUT/cuda_readback.json" "$@" 2>&1 | tee "$OUT/cuda_readback.txt"
    ;;
  shapes)
    # What a query length MLX has not run before costs, op by op (shape_costs.py),
    # under each of ${SHAPES_ENVS:-default MLX_USE_CUDA_GRAPHS=0 MLX_CUDA_USE_CUDNN_SDPA=0}
    # (arguments go to shape_costs.py: --parts adds the first layer's pieces)
    # (one process each): MLX's CUDA graphs and cuDNN attention are the
    # per-shape suspects.
    device_env
    ensure_model
    for e in ${SHAPES_ENVS:-default MLX_USE_CUDA_GRAPHS=0 MLX_CUDA_USE_CUDNN_SDPA=0}; do
      echo "== $e"
      if [ "$e" = default ]; then envs=(); else envs=("$e"); fi
      env "${envs[@]}" python3 tools/bench/shape_costs.py --model "$MODEL" \
        --json "$OUT/shape_costs-${e//[^A-Za-z0-9]/_}.json" "$@" 2>&1
    done | tee "$OUT/shape_costs.txt"
    ;;
  compiled)
    # A batch decode step compiled (mx.compile) against kvtier's and mlx-lm's
    # built-per-token steps, in process (compiled_decode.py; arguments go to it).
    device_env
    ensure_model
    python3 tools/bench/compiled_decode.py --model "$MODEL" --json "$OUT/compiled_decode.json" "$@" 2>&1 \
      | tee "$OUT/compiled_decode.txt"
    ;;
  newshapes)
    # Served joins rarely repeat a shape (each has its own group size, suffix
    # and cached length); lonejoin's rounds do. Here every burst is one token
    # longer than the last: 1 and 8 rows x ~24 tokens over a cached 5,100,
    # beside 0 and 4 decoding rows, kvtier's dispatch with prefill folding on
    # and off (--attention fold,on), interleaved; under each environment of
    # ${NS_ENVS:-default KVTIER_BATCH_PREFILL_BUCKET=32 MLX_USE_CUDA_GRAPHS=0}
    # (prefill buckets; MLX's CUDA graphs off), one process per burst size;
    # NS_ATTENTION picks the dispatches (e.g. on,buckets: attention at
    # bucketed shapes, KVTIER_CUDA_ATTENTION_BUCKETS).
    device_env
    ensure_model
    for e in ${NS_ENVS:-default KVTIER_BATCH_PREFILL_BUCKET=32 MLX_USE_CUDA_GRAPHS=0}; do
      if [ "$e" = default ]; then envs=(); else envs=("$e"); fi
      for b in 1 8; do
        echo "== $e, burst $b"
        env "${envs[@]}" python3 tools/bench/join_cost.py --model "$MODEL" --tok-dir .gpu/tok --burst "$b" \
          --prefix-tokens 5100 --suffix-tokens 24 --max-tokens 8 --prompt-tokens 530 \
          --prefill-step-size 2048 --rounds "${ROUNDS:-2}" --background 0,4 --attention "${NS_ATTENTION:-fold,on}" --new-shapes \
          --json "$OUT/newshapes-${e//[^A-Za-z0-9]/_}-b$b.json" 2>&1 | grep -E "synchronized|phases|plain"
      done
    done | tee "$OUT/newshapes.txt"
    ;;
  lonejoin)
    # Issue 20's agent turn, the lone row: served at be8d971, one row joining
    # with 23-25 prefill tokens over a lent 5,162-token prefix took 142-149 ms
    # engine-side (its batch.join_step lines) against 128 ms in process for
    # 8 rows x 40 tokens. In process here: 1 and 8 rows x 24 tokens over a
    # cached 5,100, nothing else decoding, 3 rounds; then the same with a
    # snapshot point 8 tokens into each suffix (served rows ask the prompt
    # cache for one).
    device_env
    ensure_model
    for snap in 0 8; do
      for b in 1 8; do
        python3 tools/bench/join_cost.py --model "$MODEL" --tok-dir .gpu/tok --burst "$b" \
          --prefix-tokens 5100 --suffix-tokens 24 --max-tokens 16 --prompt-tokens 530 \
          --prefill-step-size 2048 --rounds 3 --background 0 --attention on --snapshot-tokens "$snap" \
          --json "$OUT/lonejoin-b$b-s$snap.json" 2>&1 | grep -E "synchronized|phases" | sed "s/^/snapshot=$snap /"
      done
    done | tee "$OUT/lonejoin.txt"
    ;;
  extras)
    # The SSD tier on vs off (20 sequential distinct requests), the
    # checkpoint restart at 75 % of a ${CK_TOKENS:-2000}-token answer and which
    # answers differ where (checkpoint_parity.py), on the model `run` wrote.
    device_env
    ensure_model
    python3 tools/bench/ssd_ttft.py --model "$MODEL" --requests 20 --prompt-tokens 530 --max-tokens 48 \
      --json "$OUT/ssd_ttft.json" --plot "$OUT/ssd_ttft.png" 2>&1 | tail -n 40 | tee "$OUT/ssd_ttft.txt" || true
    # NOTE: EXTRAS=ssd stops here (the checkpoint lines below were met and recorded).
    if [ "${EXTRAS:-all}" = ssd ]; then exit 0; fi
    python3 tools/bench/checkpoint.py --model "$MODEL" --tokens "${CK_TOKENS:-2000}" --repeats "${CK_REPEATS:-3}" \
      > "$OUT/checkpoint.json" 2> "$OUT/checkpoint.err" || true
    tail -c 3000 "$OUT/checkpoint.json"; tail -n 5 "$OUT/checkpoint.err"
    # NOTE: checkpoint.py's answers_equal is one flag over every pair; this
    # names the pair that differs and the token where it does.
    python3 tools/bench/checkpoint_parity.py --model "$MODEL" --tokens "${CK_TOKENS:-2000}" \
      > "$OUT/checkpoint_parity.json" 2> "$OUT/checkpoint_parity.err" || true
    tail -c 1500 "$OUT/checkpoint_parity.json"
    ;;
  ssdprofile)
    # Issue 20's SSD line (decode 0.63 x with the tier on): ${N:-80} sequential
    # distinct requests through one `kvtier serve` (ssd_ttft.py, MODE=${MODE:-on};
    # MODE=off for the reference) while py-spy samples the server's threads,
    # once ${PROFILE_DELAY:-20} s in: 10 s of every thread (--idle), then 10 s
    # of the GIL's holder only (--gil). Writes ssdprofile.txt (the requests),
    # pyspy-all.txt / pyspy-gil.txt (raw stacks) and threads-all.txt /
    # threads-gil.txt (tools/bench/pyspy_threads.py). Environment variables
    # reach the server; extra arguments go to ssd_ttft.py.
    device_env
    ensure_model
    spy=$(find "$SITE" -name py-spy -type f | head -1)
    python3 tools/bench/ssd_ttft.py --model "$MODEL" --modes "${MODE:-on}" --requests "${N:-80}" \
      --prompt-tokens 530 --max-tokens 48 --json "$OUT/ssd_ttft-${MODE:-on}.json" "$@" \
      > "$OUT/ssdprofile.txt" 2>&1 &
    bg=$!
    pid=""
    for _ in $(seq 1 600); do pid=$(pgrep -f "actors.cli serve" | head -1 || true); [ -n "$pid" ] && break; sleep 0.5; done
    sleep "${PROFILE_DELAY:-20}"
    if [ -n "$pid" ] && [ -n "$spy" ]; then
      "$spy" record --pid "$pid" --duration 10 --rate 250 --threads --idle --format raw \
        -o "$OUT/pyspy-all.txt" > "$OUT/pyspy.log" 2>&1 || true
      "$spy" record --pid "$pid" --duration 10 --rate 250 --threads --gil --format raw \
        -o "$OUT/pyspy-gil.txt" >> "$OUT/pyspy.log" 2>&1 || true
    else
      echo "no server ($pid) or no py-spy ($spy)" > "$OUT/pyspy.log"
    fi
    wait $bg || true
    for kind in all gil; do
      if [ -f "$OUT/pyspy-$kind.txt" ]; then
        python3 tools/bench/pyspy_threads.py "$OUT/pyspy-$kind.txt" --top 12 > "$OUT/threads-$kind.txt" || true
      fi
    done
    tail -n 3 "$OUT/ssdprofile.txt"; head -n 60 "$OUT/threads-all.txt" 2>/dev/null || cat "$OUT/pyspy.log"
    ;;
  ssdline)
    # Issue 20's SSD line as the issue states it: TTFT p99 of 20 sequential
    # distinct requests, tier on vs off, ${PAIRS:-3} pairs of servers with
    # the order alternating (ssd_ttft.py --repeats): every pair's ratios,
    # their median and spread (one server per mode was within this GPU's
    # process-to-process spread). A variant of the tier against the same off
    # servers: extra arguments, e.g. `ssdline --on-env KVTIER_CUDA_HOST_READ=host`
    # (the writer reads host copies, not device-managed pages).
    device_env
    ensure_model
    python3 tools/bench/ssd_ttft.py --model "$MODEL" --requests "${N:-20}" --prompt-tokens 530 \
      --max-tokens 48 --repeats "${PAIRS:-3}" --json "$OUT/ssd_ttft.json" --plot "$OUT/ssd_ttft.png" "$@" \
      2>&1 | tee "$OUT/ssd_ttft.txt" | tail -n 12
    ;;
  ssdvariants)
    # Which part of the SSD tier's write-behind slows decoding (issue 20's SSD
    # line; decode 0.63 x with the tier on): ssd_ttft.py once with the tier
    # off, then with it on under each variant, ${N:-20} sequential distinct
    # requests each, one server per variant. One summary line per variant.
    device_env
    ensure_model
    run_variant() {  # name, then environment assignments / ssd_ttft.py arguments
      local name=$1; shift
      local envs=() args=()
      for a in "$@"; do case $a in KVTIER_*=*) envs+=("$a");; *) args+=("$a");; esac; done
      env "${envs[@]}" python3 tools/bench/ssd_ttft.py --model "$MODEL" --requests "${N:-20}" \
        --prompt-tokens 530 --max-tokens 48 --json "$OUT/ssd-$name.json" "${args[@]}" \
        > "$OUT/ssd-$name.txt" 2>&1 || true
      echo "$name: $(tail -n 1 "$OUT/ssd-$name.txt")"
    }
    run_variant off --modes off
    run_variant on --modes on
    run_variant writebehind-off --modes on --serve-arg=--ssd-writebehind --serve-arg=off
    run_variant host-read-direct --modes on KVTIER_CUDA_HOST_READ=direct
    run_variant release-buffer-cache --modes on KVTIER_CUDA_RELEASE_CACHE=on
    ;;
  ckpt)
    # Issue 23's decode cost of generation checkpoints at the default interval
    # (every 100 tokens) against none, ${CK_STREAMS:-8 1} streams in turn
    # (CK_CONTENDERS=off=.:0,on=.:100 drops the whole read-backs: 6 runs, not 9;
    # CK_MAX_BATCH=32 CK_STREAMS=1: one answer as a batch row, as kvtier serve runs a lone client on CUDA;
    # 8 streams took ~35 s a run at the 8B shape, each server's start included),
    # each contender in its own process, interleaved, ${CK_REPEATS:-3} repeats,
    # on the model `run` wrote (KVTIER_GPU_SHAPE picks another shape).
    device_env
    ensure_model
    # NOTE: first where a checkpoint's time goes on the batch lane (in-step
    # capture, views turn, finish turn, the step after them), in process.
    # Deltas (the default under CUDA) and whole read-backs (KVTIER_CHECKPOINT_DELTA=0).
    # CK_PROBE="1" (deltas only) or "" (none) shortens it: ~60 s each at the 8B shape.
    for d in ${CK_PROBE-1 0}; do
      KVTIER_CHECKPOINT_DELTA=$d python3 tools/bench/checkpoint_cost.py --model "$MODEL" \
        --batch-rows "${CK_ROWS:-8}" --tokens "${CK_TOKENS:-600}" --every 100 --repeats "${CK_REPEATS:-3}" \
        > "$OUT/checkpoint-cost-delta$d.json" 2> "$OUT/checkpoint-cost-delta$d.err" || true
      echo "delta=$d"
      grep -v '^      ' "$OUT/checkpoint-cost-delta$d.json" | head -n 24 || tail -n 5 "$OUT/checkpoint-cost-delta$d.err"
    done
    # NOTE: a baseline tree beside the working tree, when one was carried:
    #   git archive <commit> actors kernels messages tools | tar -x -C .gpu/tok/base
    #   echo <commit> > .gpu/tok/base/.bench-label
    # (the device's copy has no usable .git; .gpu/tok travels with call 2).
    # CK_CONTENDERS replaces the list, e.g. with a contender's environment:
    #   off=.:0,on=.:100,lend=.:100:KVTIER_BACKGROUND_IN_CHAIN=on
    #   off=.:0,on=.:100,ahead=.:100:KVTIER_CHECKPOINT_READ_AHEAD=on (a step's checkpoints read back together)
    contenders=off=.:0,whole=.:100:KVTIER_CHECKPOINT_DELTA=0,on=.:100
    if [ -d .gpu/tok/base ]; then contenders=off=.:0,base=.gpu/tok/base:100,on=.:100; fi
    contenders=${CK_CONTENDERS:-$contenders}
    for n in ${CK_STREAMS:-8 1}; do
      python3 tools/bench/checkpoint.py --model "$MODEL" --batch-streams "$n" --max-batch "${CK_MAX_BATCH:-0}" \
        --batch-tokens "${CK_TOKENS:-600}" --contenders "$contenders" \
        --repeats "${CK_REPEATS:-3}" --out "$OUT/checkpoint-onoff-$n.json" \
        --plot "$OUT/checkpoint-onoff-$n.png" > /dev/null 2> "$OUT/checkpoint-onoff-$n.err" || true
      python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[2], "streams:", {k: v for k, v in d.items() if not isinstance(v, (list, dict))})' \
        "$OUT/checkpoint-onoff-$n.json" "$n" || tail -n 5 "$OUT/checkpoint-onoff-$n.err"
    done
    ;;
  cluster)
    # Issue 24's CPU lines where cores are not the bound: N replicas of the
    # default model's shape (random fp32 weights written here: the weights
    # cannot be carried, and the trace's replies are scripted, so the answers'
    # text does not matter) on MLX's CPU backend (--device cpu), each pinned
    # to its share of the 16 cores, behind round-robin, sglang-router's
    # cache_aware and the event router, at the balance thresholds the 2-core
    # runs used (docs/benchmarks/cluster.md). CL_POINTS: REPLICAS:AGENTS load
    # points, each a cluster.py run of 2 x AGENTS conversations of 10 calls
    # with CL_TOOL_S s of tool time, cut at CL_POINT_S s. CL_RATE (conversations
    # a second) makes each point open loop (cluster.py --arrival-rate);
    # CL_RATE_FRACTION instead sets that rate at this fraction of round-robin's
    # capacity on this host, measured first (--arrival-rate-fraction: a
    # closed-loop replay of 2 agents a replica, no tool time; ~1-2 minutes).
    # NOTE: an open loop keeps the 2 x AGENTS conversations but not the agents:
    # conversations arrive on a seeded Poisson schedule whatever the earlier
    # ones are doing, so round-robin's queue can grow where the cache routers'
    # does not (the anchors' regime; closed-loop agents slow down with their
    # answers instead); the printout gives the concurrency measured.
    device_env
    ob=$HOME/kvtier-gpu/openblas
    if [ ! -f "$ob/libblas.so.3" ] && [ -f "$HOME/kvtier-gpu/stash/openblas.tar.xz" ]; then
      mkdir -p "$ob" && tar -xJf "$HOME/kvtier-gpu/stash/openblas.tar.xz" -C "$ob"
    fi
    if [ -f "$ob/libblas.so.3" ]; then
      export LD_PRELOAD=$ob/libblas.so.3 LD_LIBRARY_PATH=$ob${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    else
      echo "no OpenBLAS carried: MLX's bundled reference BLAS (prefill ~20x slower)"
    fi
    export KVTIER_DEVICE=cpu
    cpu_model=${KVTIER_CPU_MODEL:-/tmp/kvtier-gpu/smollm2-135m}
    python3 -c 'import sys; sys.path.insert(0, "tools/bench"); from pathlib import Path
from serving import write_random_model
write_random_model(Path(sys.argv[1]), "smollm2-135m", Path(".gpu/tok"), 0, "float32")' "$cpu_model"
    nproc
    # NOTE: the native CPU kernels build once here (the replicas would wait on
    # the build lock); a failure says why and the replicas keep MLX's products.
    python3 -m kernels.native 2>&1 | tail -n 3 || true
    python3 -c 'import time, mlx.core as mx
mx.set_default_device(mx.cpu)
a = mx.random.normal((2048, 576)); b = mx.random.normal((576, 1536)); mx.eval(a, b)
for _ in range(3): mx.eval(a @ b)
t = time.perf_counter(); n = 20
for _ in range(n): mx.eval(a @ b)
print(f"CPU fp32 matmul 2048x576x1536: {2 * 2048 * 576 * 1536 * n / (time.perf_counter() - t) / 1e9:.0f} GFLOP/s")'
    cores=$(nproc)
    for point in ${CL_POINTS:-4:8 2:4}; do
      r=${point%%:*}; c=${point##*:}
      name=cluster-${r}r-${c}a
      timeout "${CL_POINT_S:-270}" python3 tools/bench/cluster.py --replicas "$r" --concurrency "$c" \
        --conversations $((2 * c)) --turns 10 --tool-s "${CL_TOOL_S:-2}" --threads $((cores / r)) --pin \
        --balance-abs-threshold 2 --balance-rel-threshold 1.5 --overhead-n "${CL_OVERHEAD_N:-200}" \
        ${CL_RATE:+--arrival-rate "$CL_RATE"} ${CL_RATE_FRACTION:+--arrival-rate-fraction "$CL_RATE_FRACTION"} \
        --model "$cpu_model" --serve-args "--device cpu" --out "$OUT/$name" "$@" \
        > "$OUT/$name.txt" 2>&1 || echo "$name: exit $?"
      tail -n 30 "$OUT/$name.txt"
    done
    ;;
  ttft)
    # One request's time to first token through the in-process Engine and
    # through mlx-lm's stream_generate on the same ${TTFT_TOKENS:-530}-token
    # prompt (gpu_engine.py part 1, interleaved rounds; no HTTP). Extra
    # arguments go to gpu_engine.py, e.g. --variants 32:512,32:2048;
    # TTFT_CACHE=1 adds part 2 (the prompt cache's cold / shared / repeat
    # TTFT), e.g. with --cache-rows 1,32 --long-tokens 4400.
    device_env
    python3 tools/bench/gpu_engine.py --tok-dir .gpu/tok --shapes "${KVTIER_GPU_SHAPE:-llama3-8b}" \
      --decode-prompt-tokens "${TTFT_TOKENS:-530}" --max-tokens 32 --rounds "${TTFT_ROUNDS:-5}" \
      $([ -n "${TTFT_CACHE:-}" ] || echo --skip-cache) --json "$OUT/ttft.json" "$@" 2>&1 \
      | tail -n 40 | tee "$OUT/ttft.txt"
    ;;
  stepparts)
    # Where a decode step's time goes at ${SP_ROWS:-1,8,32} rows
    # (decode_step_parts.py: the weights' products alone, a plain-cache step
    # pipelined and synchronous, kvtier's batch kernel), once per MLX setting
    # in ${SP_ENVS:-default MLX_MAX_OPS_PER_BUFFER=1000 MLX_USE_CUDA_GRAPHS=0}
    # (MLX reads them once a process). No model directory needed.
    device_env
    for e in ${SP_ENVS:-default MLX_MAX_OPS_PER_BUFFER=1000 MLX_USE_CUDA_GRAPHS=0}; do
      echo "== $e"
      if [ "$e" = default ]; then envs=(); else envs=("$e"); fi
      env "${envs[@]}" python3 tools/bench/decode_step_parts.py --tok-dir .gpu/tok \
        --rows "${SP_ROWS:-1,8,32}" --label "$e" \
        --json "$OUT/parts-${e//[^A-Za-z0-9]/_}.json" "$@" 2>&1
    done | tee "$OUT/parts.txt"
    ;;
  fewrow)
    # The CUDA few-row product (kernels.model._cuda_few_row) against MLX's
    # products: numbers (exits 1 if off), the projections' speed at 1-8 rows,
    # a decode step with MLX's products, the kernel, and the kernel with q|k|v
    # as one launch (cuda_few_row.py). No model directory.
    device_env
    python3 tools/bench/cuda_few_row.py --tok-dir .gpu/tok --json "$OUT/few_row.json" "$@" 2>&1 \
      | tee "$OUT/few_row.txt"
    ;;
  looptrace)
    # Where the event loop's time goes while a new request's `admit` grows
    # with the streams (41-73 ms at 32 streams on an H100, docs/benchmarks.md
    # 2026-12-06 19:28): kvtier alone at ${LT_LEVELS:-8,32} streams with
    # loop_trace.py's sitecustomize on its PYTHONPATH (every loop iteration
    # whose callbacks worked over ${LOOP_TRACE_MS:-4} ms, callback by callback),
    # then its summary beside the level's admission phases.
    device_env
    ensure_model
    mkdir -p "$WORK"
    lt=$WORK/looptrace
    rm -rf "$lt" && python3 tools/bench/loop_trace.py site "$lt"
    python3 tools/bench/serving.py --model "$MODEL" --guidellm-python "$(command -v python3)" \
      --servers kvtier --concurrency "${LT_LEVELS:-8,32}" --requests-per-stream 2 --min-requests 4 \
      --prompt-tokens 512 --max-tokens 128 --rate-fractions '' --agent '' \
      --kvtier-env "PYTHONPATH=$lt:$PYTHONPATH" --json "$OUT/looptrace-serving.json" "$@" 2>&1 \
      | grep -v "^\s*$" | tee "$OUT/looptrace.txt"
    python3 tools/bench/loop_trace.py summary "$lt"/iters-*.jsonl --json "$OUT/looptrace.json" \
      | tee -a "$OUT/looptrace.txt"
    tar -czf "$OUT/looptrace.tgz" -C "$lt" . || true
    ;;
  memguard)
    # The memory guard when another process holds the card's memory
    # (cuda_memory_guard.py): device_info's free figure through allocations
    # and another process's hold, then `kvtier serve` answering requests
    # while a child holds all but 512 MiB of the device, this tree beside
    # .gpu/tok/base.tgz (a `git archive` of the commit before, unpacked to
    # /tmp/base) when it is there.
    device_env
    ensure_model
    base=()
    if [ -f .gpu/tok/base.tgz ]; then
      unpack_base
      base=(--baseline-tree /tmp/base)
    fi
    python3 tools/bench/cuda_memory_guard.py --model "$MODEL" "${base[@]}" \
      --json "$OUT/cuda_memory_guard.json" "$@" 2>&1 | tee "$OUT/cuda_memory_guard.txt"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d'
    exit 2
    ;;
esac
