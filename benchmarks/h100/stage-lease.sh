#!/usr/bin/env bash
# One lease's staging, re-cut so that every device call's carry plus the working tree (about 29 MB now) stays
# under the 64 MiB a call carries: TE 2.20.2 (from ../shared/device/stage-te.sh's .device-te) and FlashAttention 4
# (from stage-fa4.sh's .device-fa) in pieces of PIECE bytes, in ignored .device-lease/NN folders.
#
#   bash ../shared/device/stage-te.sh && bash ../shared/device/stage-fa4.sh   # once: the downloads
#   bash benchmarks/h100/stage-lease.sh                                        # prints the calls to make
#
# Every call but the last copies its piece to /tmp/stage on the GPU machine; the last joins them, installs TE
# (its PyTorch extension built there, about 2 minutes on 16 cores) and FA4, then runs your command.
set -euo pipefail
PIECE="${PIECE:-34000000}"  # 40 MB pieces beside a 29 MB tree went over the 64 MiB a call carries
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx "/.device-lease/" .git/info/exclude 2>/dev/null || echo "/.device-lease/" >> .git/info/exclude
[ -d .device-te ] && [ -d .device-fa ] || { echo "stage TE and FA4 first (see the header)" >&2; exit 2; }
rm -rf .device-lease && mkdir -p .device-lease/work
# TE's core wheel (stage-te.sh's parts, or this project's earlier re-cut q0..q5 pieces) and FA4's wheel tar.
if ls .device-te/q*/piece* >/dev/null 2>&1; then
    cat .device-te/q0/piece0 .device-te/q1/piece1 .device-te/q2/piece2 .device-te/q3/piece3 \
        .device-te/q4/piece4 .device-te/q5/piece5 > .device-lease/work/te-core
    te_meta=.device-te/q5/p4
else
    cat .device-te/p0/part0 .device-te/p1/part1 .device-te/p2/part2 .device-te/p3/part3 \
        .device-te/p4/part4 > .device-lease/work/te-core
    te_meta=.device-te/p4
fi
cat .device-fa/p*/part? > .device-lease/work/fa4-wheels.tar
(cd .device-lease/work && split -b "$PIECE" -d -a 2 te-core te. && split -b "$PIECE" -d -a 2 fa4-wheels.tar fa.)
rm .device-lease/work/te-core .device-lease/work/fa4-wheels.tar
n=0
for piece in .device-lease/work/te.* .device-lease/work/fa.*; do
    dir=$(printf ".device-lease/%02d" "$n"); mkdir -p "$dir"; mv "$piece" "$dir/"; n=$((n + 1))
done
rmdir .device-lease/work
last=.device-lease/last
mkdir -p "$last/te" "$last/fa"
cp -r "$te_meta"/core.name "$te_meta"/core.sha256 "$te_meta"/install-te.sh "$te_meta"/whl "$te_meta"/*.tar.gz "$last/te/"
cp .device-fa/p*/wheels.sha256 .device-fa/p*/install-fa4.sh "$last/fa/"
[ -d .device-js ] && cp -r .device-js "$last/js"
cat > "$last/install.sh" <<'SH'
#!/usr/bin/env bash
# Runs ON the GPU machine in the last staging call: joins the pieces, installs TE and FA4 (and jsonschema).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ -d "$here/js" ] && python3 -m pip install -q --no-index --no-deps "$here"/js/*.whl
cd /tmp/stage
cat te.* > "$here/te/part0" && : > "$here/te/part1" && : > "$here/te/part2" && : > "$here/te/part3" && : > "$here/te/part4"
rm -f te.*
bash "$here/te/install-te.sh"
rm -f "$here"/te/part?
if ls fa.* > /dev/null 2>&1; then  # FA4's pieces were carried too (a lease may leave them out)
    cat fa.* > "$here/fa/part0" && rm -f fa.*
    bash "$here/fa/install-fa4.sh"
    rm -f "$here/fa/part0"
fi
SH
cat > "$last/install-fa.sh" <<'SH'
#!/usr/bin/env bash
# Runs ON the GPU machine after install.sh installed TE alone: joins FA4's pieces (carried since) and installs FA4.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd /tmp/stage
cat fa.* > "$here/fa/part0" && rm -f fa.*
bash "$here/fa/install-fa4.sh"
rm -f "$here/fa/part0"
SH
chmod +x "$last/install.sh" "$last/install-fa.sh"
echo "Staged $n pieces in .device-lease. Device calls, back to back:"
for dir in .device-lease/[0-9]*; do
    echo "  command: mkdir -p /tmp/stage && cp $dir/* /tmp/stage/      carry: [\"$dir\"]"
done
echo "  command: bash $last/install.sh && <your GPU command>     carry: [\"$last\"]"
echo "  (TE first, FA4 later: carry only the te pieces before install.sh, then the fa pieces, then"
echo "   bash $last/install-fa.sh && <your GPU command>)"
du -sh .device-lease/* | sed 's/^/  /'
