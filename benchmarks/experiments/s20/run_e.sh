#!/bin/bash
# Session 20, one GPU: the two intranode CUDA-graph tests failed on every rank at four ranks sharing the GPU (S20D;
# the tracebacks were lost to the run's time limit) and probably at two in S20C (FFFFEE). Just those two tests, with
# their tracebacks: four ranks once, then two ranks three times.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s20e; mkdir -p $D
pack() { tar czf $OUT/s20e.tgz -C /tmp s20e; }
for n in 4 2 2 2; do
  s=$(date +%s); timeout 150 $M -n $n --output-filename $D/g${n}_$s $T -vv --tb=long -rfE tests/gpu/test_intranode.py -k cuda_graph > $D/g${n}_$s.log 2>&1
  echo "n=$n rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed" $D/g${n}_$s/1/rank.*/stdout | sort | uniq -c; pack
done
