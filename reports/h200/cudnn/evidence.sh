#!/usr/bin/env bash
# Issue 34's evidence on the H200 (not yet run: no device was lent in the session that wrote it).
# The three TE faults the tool found (reports/h200/api, reports/h200/upstream), each bisected minimal case run on
# every cuDNN build found there (system 9.14.0, which TE loads; pip 9.19.0, which torch loads), then bisected with
# the cuDNN build as a knob. Usage, from the project root on the device:  bash reports/h200/cudnn/evidence.sh DIR
set -u
out=${1:?usage: evidence.sh OUTPUT_DIR}
mkdir -p "$out"
ad() { PYTHONPATH=$PWD python3 -m attn_doctor "$@"; }
builds=${CUDNN_BUILDS:-9.14.0,9.19.0}

ad env > "$out/env.txt" 2>&1  # the "cuDNN builds" line: every build, and which one TE and torch load

declare -A cases=(
  [bias111s]="--batch 1 --seq 2 --heads 1 --head-dim 8 --dtype fp16 --mask no_mask --bias post_scale_bias:111s --seed 1234 --layout contiguous"
  [thd-head-dim]="--batch 1 --seq 1 --heads 1 --head-dim 136 --dtype fp16 --mask padding --qkv-format thd --seqlens 1 --seed 1234 --layout contiguous"
  [strided]="--batch 2 --seq 2 --heads 1 --head-dim 8 --dtype fp16 --mask no_mask --seed 1234 --layout transposed"
)
for name in "${!cases[@]}"; do
  # shellcheck disable=SC2086  # the flags are words
  ad run --backend te.fused --cudnn "$builds" ${cases[$name]} --device cuda --json "$out/run-$name.json" \
    > "$out/run-$name.txt" 2>&1
  echo "run $name: exit $?" >> "$out/exit-codes.txt"
  # shellcheck disable=SC2086
  ad bisect --backend te.fused --cudnn "${builds%%,*}" ${cases[$name]} --device cuda --out "$out/bisect-$name" \
    > "$out/bisect-$name.txt" 2>&1
  echo "bisect $name: exit $?" >> "$out/exit-codes.txt"
  ad report "$out/bisect-$name" --format issue > "$out/issue-$name.md" 2>&1
done
# The table fault x cuDNN build, read back from the rows (each row's extra.cudnn is what TE loaded).
PYTHONPATH=$PWD python3 - "$out" <<'PY' > "$out/table.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| fault | path | cuDNN asked | cuDNN TE loaded | verdict | why |\n| --- | --- | --- | --- | --- | --- |")
for path in sorted(out.glob("run-*.json")):
    for row in json.loads(path.read_text())["results"]:
        if row["family"] == "te":
            asked = row["options"].get("cudnn", {}).get("version", "as installed")
            print(f"| {path.stem[4:]} | {row['backend']} | {asked} | {row['extra'].get('cudnn', 'n/a')} | "
                  f"{row['verdict']} | {row['reason'][:120]} |")
PY
