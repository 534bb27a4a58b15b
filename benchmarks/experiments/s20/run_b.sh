#!/bin/bash
# Session 20, one GPU. Carry [".carry"] (.carry/vprologue = git archive s19-prologue ...).
#  1. graph_ab.py on branch s19-prologue and HEAD, alternating twice: the graph timing's spread, with and without
#     the host's submission latency inside the span (S20A's graph column went against the branch).
#  2. ncu over one dispatch of the branch (run_next.sh ncu's sections): the warps' stall reasons.
set -u
source benchmarks/experiments/device_env.sh
D=/tmp/s20b; mkdir -p $D
pack() { tar czf $OUT/s20b.tgz -C /tmp s20b; }
GA=$PWD/benchmarks/experiments/s20/graph_ab.py
for v in branch head branch2 head2; do
  case $v in branch*) dir=$PWD/.carry/vprologue;; *) dir=$PWD;; esac
  s=$(date +%s); (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 120 $M -n 1 python3 $GA > $D/ga_$v.log 2>&1)
  echo "graph_ab $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  |rror" $D/ga_$v.log | head -6; pack
done
cd .carry/vprologue; export PYTHONPATH=/tmp/site:$PWD
s=$(date +%s)
timeout 280 $M -n 1 ncu --clock-control none --kernel-name regex:dispatch --launch-skip 20 --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
    -o $D/ncu_dispatch python3 $OLDPWD/benchmarks/experiments/s18/ll_host_profile.py --calls 10 > $D/ncu_run.log 2>&1
echo "ncu rc=$? $(( $(date +%s)-s ))s"; tail -3 $D/ncu_run.log
ncu -i $D/ncu_dispatch.ncu-rep --page details > $D/ncu_details.txt 2>&1
ncu -i $D/ncu_dispatch.ncu-rep --page source --csv --print-source sass > $D/ncu_source_sass.csv 2>&1
pack; grep -a -i -E "stall|warp cycles|issued" $D/ncu_details.txt | head -30
