#!/usr/bin/env bash
# Issue 52 on the GPU: TE releases as a knob. With TE 2.20.2 installed in the environment (stage-lease.sh) and
# 2.18.0 prepared beside it (benchmarks/h100/stage-te-release.sh 2.18.0, whose add.sh runs `attn-doctor te add`):
# the releases `--te` sees, the default run on each release, the three TE faults' minimal cases on each release
# and each cuDNN build, and the table fault x release x build read back from the rows. Then (PHASE=bisect) each
# fault bisected from TE 2.18.0 with the release as a knob. From the project root on the device:
#   bash reports/h100/te-releases/evidence.sh DIR [run|bisect]
set -u
out=${1:?usage: evidence.sh OUTPUT_DIR [run|bisect]}
phase=${2:-run}
mkdir -p "$out"
ad() { PYTHONPATH=$PWD COLUMNS=100 python3 -m attn_doctor "$@"; }
releases=${TE_RELEASES:-2.18.0,2.20.2}
builds=${CUDNN_BUILDS:-9.14.0,9.19.0}
# the minimal cases of reports/h200/cudnn/evidence.sh (bisected there)
declare -A cases=(
  [bias111s]="--batch 1 --seq 2 --heads 1 --head-dim 8 --dtype fp16 --mask no_mask --bias post_scale_bias:111s --seed 1234 --layout contiguous"
  [thd-head-dim]="--batch 1 --seq 1 --heads 1 --head-dim 136 --dtype fp16 --mask padding --qkv-format thd --seqlens 1 --seed 1234 --layout contiguous"
  [strided]="--batch 2 --seq 2 --heads 1 --head-dim 8 --dtype fp16 --mask no_mask --seed 1234 --layout transposed"
)
if [ "$phase" = run ]; then
  ad env > "$out/env.txt" 2>&1
  ad te list > "$out/te-list.txt" 2>&1
  echo "te list: exit $?" >> "$out/exit-codes.txt"
  ad run --device cuda --te "$releases" --json "$out/run-default.json" > "$out/run-default.txt" 2>&1
  echo "run default --te $releases: exit $?" >> "$out/exit-codes.txt"
  for one in bias111s thd-head-dim strided; do
    # shellcheck disable=SC2086  # the flags are words
    ad run --backend te.fused --te "$releases" --cudnn "$builds" ${cases[$one]} --device cuda \
      --json "$out/run-$one.json" > "$out/run-$one.txt" 2>&1
    echo "run $one --te $releases --cudnn $builds: exit $?" >> "$out/exit-codes.txt"
  done
  ad run --te 2.17.0 --backend te.fused --device cuda > "$out/refused.txt" 2>&1
  echo "run --te 2.17.0 (not prepared): exit $?" >> "$out/exit-codes.txt"
  # The table: per fault, per TE release, per cuDNN build, the verdict, read back from each row (extra.te: the TE
  # its worker imported; extra.cudnn: the cuDNN that TE loaded).
  PYTHONPATH=$PWD python3 - "$out" <<'PY' > "$out/table.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| case | path | TE asked | TE imported | cuDNN asked | cuDNN TE loaded | verdict | why |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for path in sorted(out.glob("run-*.json")):
    for row in json.loads(path.read_text())["results"]:
        if row["family"] == "te":
            options = row["options"]
            print(f"| {path.stem[4:]} | {row['backend']} | {options.get('te', {}).get('version', 'as installed')} | "
                  f"{row['extra'].get('te', 'n/a')} | {options.get('cudnn', {}).get('version', 'as installed')} | "
                  f"{row['extra'].get('cudnn', 'n/a')} | {row['verdict']} | {row['reason'][:110]} |")
PY
  cat "$out/exit-codes.txt" "$out/table.md"
else
  for one in bias111s thd-head-dim strided; do
    # shellcheck disable=SC2086
    timeout -s INT --kill-after=10 "${BISECT_LIMIT:-150}" env PYTHONPATH="$PWD" COLUMNS=100 python3 -m attn_doctor \
      bisect --backend te.fused --te "${releases%%,*}" --cudnn "${builds%%,*}" ${cases[$one]} --device cuda \
      --out "$out/bisect-$one" > "$out/bisect-$one.txt" 2>&1
    echo "bisect $one --te ${releases%%,*}: exit $?" >> "$out/exit-codes.txt"
    ad report "$out/bisect-$one" --format issue > "$out/issue-$one.md" 2> "$out/issue-$one.advice.txt"
    echo "report $one: exit $?" >> "$out/exit-codes.txt"
    grep -i "TE rel\|fixed by\|reproduced with" "$out/bisect-$one.txt" "$out/issue-$one.md" | head -5
  done
  cat "$out/exit-codes.txt"
fi
