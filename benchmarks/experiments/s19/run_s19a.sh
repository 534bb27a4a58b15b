#!/bin/bash
# S19A (one H200; the two-GPU kind was not lent): what of session 18's run_next.sh one GPU can run, at ONE rank:
# racecheck + synccheck over the LL soak (since 8f1af6a moved the combine's buffer check), the LL soak, the stamped
# LL benchmark (cfee17d's finer stamps: send_first_stored, recv_copy_start, recv_row_seen), the host-time profile
# (ll_host_profile.py) and the LL test file.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s19a; mkdir -p $D
pack() { tar czf $OUT/s19a.tgz -C /tmp s19a; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for tool in racecheck synccheck; do
  (export CUPY_EP_TIMEOUT_S=60; run san_${tool}_ll1 100 $M -n 1 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
done
(export CUPY_EP_TIMEOUT_S=15; run ll_soak_1rank 60 $M -n 1 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
run llb_stamps1 120 $M -n 1 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/llb1
grep -a -E "^  ll_.*(graph|steady|host)|phases|VERIF|rror" $D/llb_stamps1.log | head -24
run ll_host_profile 100 $M -n 1 python3 benchmarks/experiments/s18/ll_host_profile.py --calls 1000
grep -a -A 26 "^== " $D/ll_host_profile.log | head -60
run ll_tests1 120 $M -n 1 $T tests/gpu/test_low_latency.py
