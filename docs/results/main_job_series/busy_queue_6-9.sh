#!/bin/bash
# Runs 6-9 of the busy series (run as: busy_queue_6-9.sh 6 7 8 9; the clone /tmp/fr_ship2 at 9432d64): `python train.py` (configs/default.yaml, seed 0, games/prior/compiles
# cached in this clone), each with one busy-loop process beside it for the whole run; the 1-min load every 10 s.
cd /tmp/fr_ship2
. /work/main/.venv/bin/activate
for i in "$@"; do
  out=runs/series_busy/busy_$i
  [ -f $out/summary.json ] && continue
  [ -f /tmp/s/stop_busy ] && break
  rm -rf $out; mkdir -p $out
  python3 -c 'while True: pass' &
  busy=$!
  ( while kill -0 $busy 2>/dev/null; do echo "$(date +%s) $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/load.txt; sleep 10; done ) &
  echo "$(date -u +%FT%TZ) start $i (busy loop pid $busy, HEAD $(git rev-parse --short HEAD))" >> runs/series_busy/queue.log
  /usr/bin/time -v python train.py --output_dir $out --progress false > $out/train.log 2> $out/time.txt
  echo "$(date -u +%FT%TZ) end $i rc=$?" >> runs/series_busy/queue.log
  kill $busy; wait $busy 2>/dev/null
  sleep 20
done
