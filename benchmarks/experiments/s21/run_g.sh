#!/bin/bash
# S21G (kind nvidia-h200, one rank; carry [".carry"]): ncu over one low-latency combine, 24-bit and LogFMT-10
# partials: why LogFMT costs 5.4 us at one rank (S21D). Stall reasons and instruction counts per variant.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s21g; mkdir -p $D
pack() { tar czf $OUT/s21g.tgz -C /tmp s21g; }
for v in plain logfmt; do
  flag=""; [ $v = logfmt ] && flag="--logfmt"
  s=$(date +%s)
  timeout 150 $M -n 1 ncu --clock-control none --kernel-name regex:combine --launch-skip 5 --launch-count 1 \
      --section WarpStateStats --section SchedulerStats --section InstructionStats --section SpeedOfLight \
      -o $D/ncu_$v python3 benchmarks/experiments/s21/combine_calls.py $flag > $D/ncu_run_$v.log 2>&1
  echo "ncu $v rc=$? $(( $(date +%s)-s ))s"; tail -2 $D/ncu_run_$v.log
  ncu -i $D/ncu_$v.ncu-rep --page details > $D/ncu_details_$v.txt 2>&1
  pack; grep -a -i -E "Duration|Executed Instructions |Stall|Issued Warp|Issue Slots Busy" $D/ncu_details_$v.txt | head -16
done
