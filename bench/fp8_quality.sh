#!/bin/sh
# FP8 and bf16-moment quality on `debug` (docs/FP8.md, "Quality"): per seed (1, 2, 3) a bf16 start to step
# 1000 of a 2000-step schedule, then steps 1000..2000 as bf16, --fp8, --moments bf16, both, and --eager
# (the rounding-only spread), on GPUs 0 and 1 side by side; the held-out loss of every run's weights over
# 16 batches of files the training text never saw. Data: the machine's Python sources. Prints a table.
#   make train && OUT=/tmp/q sh bench/fp8_quality.sh        (two GPUs, ~4 minutes on H200s)
export NCCL_NVLS_ENABLE=0
set -u
mkdir -p "$OUT"
python3 - $OUT <<'P'
import os, glob, hashlib, sys, struct
out = sys.argv[1]
roots = sorted(set(glob.glob('/opt/torch/.venv/lib/python3*/site-packages') + glob.glob('/usr/lib/python3*') + glob.glob('/usr/local/lib/python3*')))
files = []
for r in roots:
    files += [f for f in glob.glob(r + '/**/*.py', recursive=True) if os.path.isfile(f) and os.path.getsize(f) >= 2048]
files = sorted(set(files))
tr, ho = bytearray(), bytearray()
for f in files:
    b = open(f, 'rb').read()
    if int(hashlib.md5(f.encode()).hexdigest(), 16) % 40 == 0:
        if len(ho) < 16 * 8 * 2049: ho += b
    elif len(tr) < 40 << 20:
        tr += b
tr = bytes(tr[:40 << 20]); ho = bytes(ho[:16 * 8 * 2049])
open('/tmp/train.txt', 'wb').write(tr)
open('/tmp/held.i32', 'wb').write(struct.pack('<%di' % len(ho), *ho))
print('files', len(files), 'train bytes', len(tr), 'md5', hashlib.md5(tr).hexdigest()[:12], 'held-out tokens', len(ho), 'md5', hashlib.md5(ho).hexdigest()[:12])
P
ev() { CUDA_VISIBLE_DEVICES=$1 timeout 60 ./train --preset debug --load $2 --forward /tmp/held.i32 > $3 2>&1 || echo "FAIL eval $2"; }
base() {  # gpu seed: bf16 to step 1000 of a 2000-step schedule
  CUDA_VISIBLE_DEVICES=$1 timeout 200 ./train --preset debug --data /tmp/train.txt --steps 1000 --decay-steps 2000 --seed $2 --log-every 500 \
    --metrics $OUT/b_$2.jsonl --save /tmp/base_$2 > $OUT/b_$2.log 2>&1 || echo "FAIL base $2"
  ev $1 /tmp/base_$2 $OUT/hb_$2.log
}
cont() {  # gpu, then "seed:name:flags" items: steps 1000..2000 from the seed's bf16 base
  g=$1; shift
  for it in "$@"; do
    s=${it%%:*}; r=${it#*:}; n=${r%%:*}; f=${r#*:}; f=$(echo "$f" | tr ',' ' ')
    CUDA_VISIBLE_DEVICES=$g timeout 200 ./train --preset debug --data /tmp/train.txt --steps 2000 --load /tmp/base_$s $f --log-every 500 \
      --metrics $OUT/q_${n}_$s.jsonl --save /tmp/ck_${n}_$s > $OUT/q_${n}_$s.log 2>&1 || echo "FAIL $n $s"
    ev $g /tmp/ck_${n}_$s $OUT/h_${n}_$s.log
  done
}
(base 0 1; base 0 3) & base 1 2 & wait
cont 0 1:bf16: 1:fp8:--fp8 1:bf16m:--moments,bf16 1:fp8m:--fp8,--moments,bf16 1:eager:--eager 3:bf16: 3:fp8:--fp8 3:bf16m:--moments,bf16 &
cont 1 2:bf16: 2:fp8:--fp8 2:bf16m:--moments,bf16 2:fp8m:--fp8,--moments,bf16 2:eager:--eager 3:fp8m:--fp8,--moments,bf16 3:eager:--eager &
wait
python3 - $OUT <<'P'
import json, sys, glob, re, statistics as S
out = sys.argv[1]
R = {}
for f in glob.glob(out + '/q_*.jsonl'):
    n, s = re.match(r'.*/q_(\w+)_(\d+)\.jsonl', f).groups()
    m = [json.loads(l) for l in open(f)]
    h = open(out + '/h_%s_%s.log' % (n, s)).read()
    hl = re.search(r'^loss ([0-9.]+)', h, re.M)
    R[(n, int(s))] = (S.mean(x['loss'] for x in m[-100:]), float(hl.group(1)) if hl else float('nan'), S.median(x['step_ms'] for x in m[10:]), len(m))
for s in (1,2,3):
    try: print('base seed %d step 1000: held-out %s' % (s, re.search(r'^loss ([0-9.]+)', open(out + '/hb_%d.log' % s).read(), re.M).group(1)))
    except Exception as e: print('base', s, e)
print('run     seed  train(last100)  held-out   step_ms  steps')
for k in sorted(R): print('%-7s %4d  %12.5f  %9.5f  %8.2f  %5d' % (k[0], k[1], *R[k]))
for a, b in (('eager', 'bf16'), ('fp8', 'bf16'), ('bf16m', 'bf16'), ('fp8m', 'bf16m'), ('fp8m', 'bf16')):
    for i, what in ((1, 'held-out'), (0, 'train')):
        d = [100 * (R[(a, s)][i] / R[(b, s)][i] - 1) for s in (1, 2, 3) if (a, s) in R and (b, s) in R]
        if d: print('%-6s vs %-5s %-9s paired %%: %s  mean %+.3f%%  sd %.3f' % (a, b, what, ' '.join('%+.3f' % x for x in d), S.mean(d), S.stdev(d) if len(d) > 1 else 0))
bh = [R[('bf16', s)][1] for s in (1, 2, 3) if ('bf16', s) in R]
if len(bh) > 1: print('bf16 held-out across seeds: mean %.5f sd %.5f (%.3f%%)' % (S.mean(bh), S.stdev(bh), 100 * S.stdev(bh) / S.mean(bh)))
P
cd $OUT && tar czf q.tgz q_*.jsonl q_*.log h_*.log b_* hb_* && rm -f q_*.jsonl q_*.log h_*.log b_* hb_*
