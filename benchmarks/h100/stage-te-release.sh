#!/usr/bin/env bash
# A second TE release for the lent GPU machine (issue 52), to prepare there with `attn-doctor te add VERSION --from`
# beside the TE 2.20.2 that stage-lease.sh installs (TE's Python dependencies come from that install).
#
#   bash benchmarks/h100/stage-te-release.sh 2.18.0      # on this machine: downloads, cuts, prints the calls
#
# Downloads for the GPU image (Python 3.12, x86_64, CUDA 13): transformer-engine (pure Python) and
# transformer-engine-cu13 (the core library) wheels, and transformer-engine-torch's source distribution (built on
# the GPU machine against its torch); one tar of the three, cut into pieces of PIECE bytes under the ignored
# .device-release/NN, each one call's carry; .device-release/last/add.sh joins them there and runs `te add`.
set -euo pipefail
VERSION=${1:?a TE version, e.g. 2.18.0}
PIECE="${PIECE:-40000000}"
root=$(git rev-parse --show-toplevel)
cd "$root"
dest=.device-release
grep -qx "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >> .git/info/exclude
rm -rf "$dest" && mkdir -p "$dest/dl/te-$VERSION" "$dest/last"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dest/dl/te-$VERSION" "transformer-engine-cu13==$VERSION" \
    "transformer-engine==$VERSION"
# the extension's sdist: pip fetches it before preparing its metadata, which needs its build dependencies and can
# fail here; the file is what counts
python3 -m pip download -q --no-deps -d "$dest/dl/te-$VERSION" "transformer-engine-torch==$VERSION" > /dev/null 2>&1 || true
ls "$dest/dl/te-$VERSION"/transformer_engine_torch-"$VERSION".tar.gz > /dev/null
(cd "$dest/dl" && sha256sum te-"$VERSION"/* > "../last/te-$VERSION.sha256" && tar cf release.tar "te-$VERSION" \
    && split -b "$PIECE" -d -a 2 release.tar piece.)
n=0
for piece in "$dest"/dl/piece.*; do
    dir=$(printf "%s/%02d" "$dest" "$n"); mkdir -p "$dir"; mv "$piece" "$dir/"; n=$((n + 1))
done
rm -rf "$dest/dl"
cat > "$dest/last/add.sh" <<SH
#!/usr/bin/env bash
# ON the GPU machine, from the project root, after the piece calls: join, check, and prepare TE $VERSION.
set -euo pipefail
here=\$(cd "\$(dirname "\$0")" && pwd)
mkdir -p /tmp/te-release && cd /tmp/te-release
cat /tmp/stage-release/piece.* | tar xf - && rm -f /tmp/stage-release/piece.*
sha256sum -c "\$here/te-$VERSION.sha256"
cd - > /dev/null
PYTHONPATH=\$PWD python3 -m attn_doctor te add $VERSION --from /tmp/te-release/te-$VERSION
SH
chmod +x "$dest/last/add.sh"
echo "Staged TE $VERSION in $n pieces. After TE 2.20.2 is installed (stage-lease.sh), device calls back to back:"
for dir in "$dest"/[0-9]*; do
    echo "  command: mkdir -p /tmp/stage-release && cp $dir/* /tmp/stage-release/      carry: [\"$dir\"]"
done
echo "  command: bash $dest/last/add.sh && <your GPU command, e.g. --te $VERSION>     carry: [\"$dest/last\"]"
du -sh "$dest"/* | sed 's/^/  /'
