#!/bin/bash
# Session 20, one GPU: S20C's `tests/gpu` at two ranks sharing the GPU showed FFFFEE in the tests before the LL
# files and then died in test_nvshmem (SIGSEGV, the summary lost). Again with one line per test and per-rank output
# files (test_nvshmem now skips where ranks share a GPU), then at four ranks sharing it.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s20d; mkdir -p $D
pack() { tar czf $OUT/s20d.tgz -C /tmp s20d; }
s=$(date +%s); timeout 300 $M -n 2 --output-filename $D/gpu2 $T -vv --tb=short -rfE tests/gpu > $D/gpu2.log 2>&1
echo "gpu2 rc=$? $(( $(date +%s)-s ))s"; pack
grep -a -h -E "FAILED|ERROR|passed|failed" $D/gpu2/1/rank.*/stdout | sort | uniq -c | head -30
s=$(date +%s); timeout 220 $M -n 4 --output-filename $D/gpu4 $T -vv --tb=short -rfE tests/gpu > $D/gpu4.log 2>&1
echo "gpu4 rc=$? $(( $(date +%s)-s ))s"; pack
grep -a -h -E "FAILED|ERROR|passed|failed" $D/gpu4/1/rank.*/stdout | sort | uniq -c | head -30
