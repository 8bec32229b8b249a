#!/usr/bin/env bash
# The three TE faults the tool found (reports/h200/api, reports/h200/upstream): each minimal case run on every
# cuDNN build found there (system 9.14.0, which TE loads; pip 9.19.0, which torch loads), bisected with the first
# build (the cuDNN build one of its knobs), reported as an issue body (stdout) with the reporter's advice (stderr),
# and its short repro run as a maintainer would, `python3 repro.py` in a fresh process: with the `env` line the
# body gives (the build it failed on) and with the other build's. Usage, from the project root on the device:
#   bash reports/h200/cudnn/evidence.sh DIR [CASE ...]     (CASE: bias111s thd-head-dim strided; default: all)
set -u
out=${1:?usage: evidence.sh OUTPUT_DIR [CASE ...]}
shift
mkdir -p "$out"
ad() { PYTHONPATH=$PWD python3 -m attn_doctor "$@"; }
builds=${CUDNN_BUILDS:-9.14.0,9.19.0}

[ -f "$out/env.txt" ] || ad env > "$out/env.txt" 2>&1  # every build, and which one TE and torch load

declare -A cases=(
  [bias111s]="--batch 1 --seq 2 --heads 1 --head-dim 8 --dtype fp16 --mask no_mask --bias post_scale_bias:111s --seed 1234 --layout contiguous"
  [thd-head-dim]="--batch 1 --seq 1 --heads 1 --head-dim 136 --dtype fp16 --mask padding --qkv-format thd --seqlens 1 --seed 1234 --layout contiguous"
  [strided]="--batch 2 --seq 2 --heads 1 --head-dim 8 --dtype fp16 --mask no_mask --seed 1234 --layout transposed"
)
# The loader variables of a build, as a maintainer would set them (attn-doctor's own worker variable left out).
loader() {
  PYTHONPATH=$PWD python3 - "$1" <<'PY'
import shlex, sys
from attn_doctor.machine.cudnn_builds import find_builds, loader_environment, resolve
build = resolve(sys.argv[1], find_builds())
print(" ".join(f"{k}={shlex.quote(v)}" for k, v in loader_environment(build, {}).items() if not k.startswith("ATTN_DOCTOR_")))
PY
}
for name in "${@:-bias111s thd-head-dim strided}"; do
  for one in $name; do
    # shellcheck disable=SC2086  # the flags are words
    ad run --backend te.fused --cudnn "$builds" ${cases[$one]} --device cuda --json "$out/run-$one.json" \
      > "$out/run-$one.txt" 2>&1
    echo "run $one: exit $?" >> "$out/exit-codes.txt"
    # shellcheck disable=SC2086
    ad bisect --backend te.fused --cudnn "${builds%%,*}" ${cases[$one]} --device cuda --out "$out/bisect-$one" \
      > "$out/bisect-$one.txt" 2>&1
    echo "bisect $one: exit $?" >> "$out/exit-codes.txt"
    ad report "$out/bisect-$one" --format issue > "$out/issue-$one.md" 2> "$out/issue-$one.advice.txt"
    echo "report $one: exit $? ($(wc -c < "$out/issue-$one.md") characters)" >> "$out/exit-codes.txt"
    repro=$(ls "$out/bisect-$one"/repro_*.py)
    # the line the script (inline in the body) gives for the build it failed on, THIS_FILE as the script
    line=$(grep -o 'D=.* python3 THIS_FILE' "$repro" | head -1 | sed "s|THIS_FILE|$repro|")
    grep -q '```python' "$out/issue-$one.md" && echo "issue $one: the repro is inline" >> "$out/exit-codes.txt"
    (cd /tmp && eval "$line") > "$out/repro-$one-${builds%%,*}.txt" 2>&1
    echo "repro $one, its own line (${builds%%,*}): exit $? [$line]" >> "$out/exit-codes.txt"
    for build in ${builds//,/ }; do
      vars=$(loader "$build")
      (cd /tmp && eval "env $vars python3 $repro") > "$out/repro-$one-$build-loader.txt" 2>&1
      echo "repro $one, env for cuDNN $build: exit $? [$vars]" >> "$out/exit-codes.txt"
    done
  done
done
# Which cuDNN TE loads in a plain process (a maintainer's), torch imported first or TE first, with each build's
# loader variables: read back from TE and from the process's memory map.
for build in ${builds//,/ }; do
  vars=$(loader "$build")
  for order in "import torch; import transformer_engine.pytorch" "import transformer_engine.pytorch; import torch"; do
    (cd /tmp && eval "env $vars python3 -c \"$order; import transformer_engine_torch as tex; print('$build', '$order', tex.get_cudnn_version(), sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libcudnn.so' in l}))\"") \
      >> "$out/which-cudnn.txt" 2>&1
  done
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
