#!/bin/bash
# cached runs of `python train.py` in this clone (games and compiles cached by its first run),
# nothing else running, alternating the default (learner at each trajectory's length) and the
# learner before (one micro-batch at full width, batches padded to multiples of 256);
# the 1-min load every 10 s.
cd /tmp/fr_new
. /work/main/.venv/bin/activate
while pgrep -f "run_first.sh /tmp/fr_new" > /dev/null; do sleep 5; done
sleep 20
for run in new_1 old_1 new_2 old_2; do   # stopped after old_1 (/tmp/s/stop_queue)
  [ -f /tmp/s/stop_queue ] && break
  out=runs/series_ab/$run
  [ -f $out/summary.json ] && continue
  rm -rf $out; mkdir -p $out
  extra=""
  case $run in old_*) extra="--optim.num_micro_batches 1 --optim.length_bucket null --rollout.pad_to_multiple 256";; esac
  ( while [ ! -f $out/done ]; do echo "$(date +%s) $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/load.txt; sleep 10; done ) &
  echo "$(date -u +%FT%TZ) start $run (HEAD $(git rev-parse --short HEAD)) $extra" >> runs/series_ab/queue.log
  python train.py --output_dir $out --progress false $extra > $out/train.log 2>&1
  echo "$(date -u +%FT%TZ) end $run rc=$?" >> runs/series_ab/queue.log
  touch $out/done
  sleep 20
done
