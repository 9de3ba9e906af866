#!/usr/bin/env bash
# One command for the lent H200: build the extension, run every test (GPU ones included), run
# compute-sanitizer on the op tests, then the benchmarks. Logs land in $OUT (or ./h200-out).
#   bash bench/h200.sh [build|test|sanitize|ncu|bench|decode|all]...   (default: all but ncu)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/h200-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}"
export DECODEX_CACHE="$PWD/.decodex-cache"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
has() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }

if [ -d .whl ]; then  # packages the H200 image lacks (gguf), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

if has build; then
  t0=$(date +%s)
  python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  grep -E "registers|spill|stack frame" "$OUT/build.log" > "$OUT/ptxas.txt" || true
  echo "build: $(( $(date +%s) - t0 )) s"
  python3 -c "import torch, decodex; assert decodex._ext.available(), decodex._ext.why_unavailable(); print('import ok', torch.__version__, torch.cuda.get_device_name())"
fi
if has test; then
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest ${PYTEST_ARGS:-tests} -q -rs --tb=short --timeout=180 \
    -p no:cacheprovider --durations=15 > "$OUT/test.log" 2>&1
  echo "pytest exit $?"; grep -E "^(FAILED|ERROR)" "$OUT/test.log" | cut -c1-220 | head -60; tail -25 "$OUT/test.log" | cut -c1-300
fi
if has sanitize; then
  # compute-sanitizer (SANITIZE_TOOLS: memcheck, racecheck or both) over every op test file, each
  # file cut into shards (`pytest --shard K/N`, tests/conftest.py) that run SANITIZE_JOBS processes
  # at a time, longest first. SANITIZE_SHARDS lists file:memcheck shards:racecheck shards (a count
  # of 0 leaves the file out: lt_linear is cuBLASLt's, so memcheck only). A shard's log is
  # $OUT/sanitize_TOOL_FILE_KofN.log, ending in its exit. Racecheck instruments decodex's kernels only
  # (--kernel-name kns=decodex): the tests' torch and cuBLAS kernels run unchecked, which took it from
  # 19 of rms_norm's 84 cases in 520 s (15 processes at once, H200) to all 85 in 39 s (18 at once, an
  # H100; bench/RESULTS.md, sessions 33 and 37). Memcheck checks every kernel: over every file it
  # takes 43 s with 15 jobs (session 33).
  read -ra SHARDS <<< "${SANITIZE_SHARDS:-decode_attention:4:12 sample:1:6 gemv:2:8 rope_append_attention:2:4
    gemv_silu_mul:1:6 lt_linear:1:0 gemv_rope_append:1:1 rms_norm:1:2 rope_append:1:2 silu_mul:1:1
    argmax:1:1 advance_positions:1:1 moe:1:2}"
  run_shard() {  # run_shard TOOL FILE K N
    local log="$OUT/sanitize_$1_$2_$3of$4.log"
    local only=(); [ "$1" = racecheck ] && only=(--kernel-name kns=decodex)
    DECODEX_TEST_QUICK=1 timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$1" "${only[@]}" --error-exitcode 1 \
      python3 -m pytest -q -p no:cacheprovider -m gpu "tests/test_$2.py" --shard "$3/$4" > "$log" 2>&1
    echo "exit $?" >> "$log"
  }
  export -f run_shard; export OUT SANITIZE_TIMEOUT
  jobs=""
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    [ "$tool" = memcheck ] || [ "$tool" = racecheck ] || { echo "SANITIZE_TOOLS: no tool '$tool'" >&2; exit 2; }
    col=$([ "$tool" = memcheck ] && echo 2 || echo 3)
    for spec in "${SHARDS[@]}"; do
      [[ "$spec" =~ ^[a-z_]+:[0-9]+:[0-9]+$ ]] || { echo "SANITIZE_SHARDS: '$spec' is not file:memcheck:racecheck" >&2; exit 2; }
      n=$(echo "$spec" | cut -d: -f"$col")
      for ((k = 0; k < n; k++)); do jobs+="$tool ${spec%%:*} $k $n"$'\n'; done
    done
  done
  printf "%s" "$jobs" | xargs -P "${SANITIZE_JOBS:-14}" -L 1 bash -c 'run_shard "$@"' _
  # One line per tool and file: shards that exited 0, tests passed and failed, the summaries.
  count() { grep -oE "[0-9]+ $1" "$2" | tail -1 | cut -d' ' -f1; }
  shopt -s nullglob
  for log in "$OUT"/sanitize_*_0of*.log; do
    stem=${log%_0of*.log}; name=${stem#"$OUT"/sanitize_}
    ok=0; all=0; passed=0; failed=0
    for s in "$stem"_[0-9]*of[0-9]*.log; do
      all=$((all + 1)); [ "$(tail -1 "$s")" = "exit 0" ] && ok=$((ok + 1))
      p=$(count passed "$s"); f=$(count failed "$s"); passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0}))
    done
    echo "compute-sanitizer $name: $ok of $all shards exit 0, $passed passed, $failed failed;" \
      "$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$stem"_[0-9]*of[0-9]*.log | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
    grep -hE "Race reported between" "$stem"_[0-9]*of[0-9]*.log | sed -E 's/.*access at ([A-Za-z_0-9]+).*/  race in \1/' | sort | uniq -c
  done
fi
if [[ " ${steps[*]} " == *" ncu "* ]]; then  # only when asked for by name
  # Nsight Compute, clocks left alone, on one kernel call each (the third): a 1.5B gate|up GEMV
  # (17920 x 1536, M = 1) and the batch-64 attention below.
  cat > "$OUT/ncu_gemv.py" <<'PY'
import torch, decodex  # noqa: E401,F401
w = torch.randn(17920, 1536, device="cuda", dtype=torch.bfloat16)
x = torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16)
o = torch.empty(1, 17920, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    torch.ops.decodex.gemv(x, w, None, o)
torch.cuda.synchronize()
PY
  timeout 150 ncu --clock-control none --kernel-name regex:gemv_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 "$OUT/ncu_gemv.py" > "$OUT/ncu_gemv.txt" 2>&1
  echo "ncu exit $?"; grep -E "Duration|DRAM Throughput|Achieved Active Warps|Registers Per" "$OUT/ncu_gemv.txt"
  # And the batch-64 step's attention: rope_append_attention at 1.5B shapes (64 rows, 1K tokens).
  cat > "$OUT/ncu_attn.py" <<'PY'
import torch, decodex  # noqa: E401,F401
B, H, Hkv, D, S, L = 64, 12, 2, 128, 1152, 1024
qkv = torch.randn(B, (H + 2 * Hkv) * D, device="cuda", dtype=torch.bfloat16)
q, k, v = qkv[:, :H * D].view(B, H, D), qkv[:, H * D:(H + Hkv) * D].view(B, Hkv, D), qkv[:, (H + Hkv) * D:].view(B, Hkv, D)
kc = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
sms = torch.cuda.get_device_properties(0).multi_processor_count
ws = torch.empty(B, H, int(torch.ops.decodex.decode_attention_splits(B, Hkv, S, sms)), D + 2, device="cuda")
out = torch.empty(B, H, D, device="cuda", dtype=torch.bfloat16)
x = torch.randn(B, 1536, device="cuda", dtype=torch.bfloat16)
bias = torch.randn((H + 2 * Hkv) * D, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    torch.ops.decodex.rope_append_attention(q, k, v, inv_freq, lengths - 1, kc, vc, lengths, D ** -0.5, ws, out,
                                            prefetch_cache=True, rms_x=x, rms_eps=1e-6, bias=bias)
torch.cuda.synchronize()
PY
  timeout 150 ncu --clock-control none --kernel-name regex:decode_attention_split --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 "$OUT/ncu_attn.py" > "$OUT/ncu_attn.txt" 2>&1
  echo "ncu exit $?"; grep -E "Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued|Eligible Warps|Registers Per" "$OUT/ncu_attn.txt"
fi
if has bench; then
  timeout "${BENCH_TIMEOUT:-240}" python3 -m bench.run_all --out "$OUT/bench_ops.md" > "$OUT/bench_ops.log" 2>&1
  echo "bench exit $?"; cat "$OUT/bench_ops.md" 2>/dev/null | cut -c1-160 | head -150
fi
if has decode; then
  timeout "${DECODE_TIMEOUT:-300}" python3 -m bench.decode ${DECODE_ARGS:-} > "$OUT/bench_decode.md" 2>&1
  echo "decode exit $?"; tail -60 "$OUT/bench_decode.md" | cut -c1-200
fi
