#!/bin/bash
# 5 runs of `python train.py` (configs/default.yaml, seed 0, games/prior/compiles cached), each with
# one busy-loop process beside it for the whole run (one core kept busy); the 1-min load every 10 s.
cd /work/main
. .venv/bin/activate
for i in 1 2 3 4 5; do
  out=runs/series_busy/busy_$i
  [ -f $out/summary.json ] && continue
  rm -rf $out; mkdir -p $out
  python3 -c 'while True: pass' &
  busy=$!
  ( while kill -0 $busy 2>/dev/null; do echo "$(date +%s) $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/load.txt; sleep 10; done ) &
  echo "$(date -u +%FT%TZ) start $i (busy loop pid $busy, HEAD $(git rev-parse --short HEAD))" >> runs/series_busy/queue.log
  python train.py --output_dir $out --progress false > $out/train.log 2>&1
  echo "$(date -u +%FT%TZ) end $i rc=$?" >> runs/series_busy/queue.log
  kill $busy; wait $busy 2>/dev/null
  sleep 20
done
