#!/usr/bin/env bash
# Park rate (hold) and retry lateness of two nackd builds, in turn, two
# rounds each. OLD and NEW are release directories, each holding a nackd
# and a copy of the same nackd-bench (the bench starts the nackd beside it).
#   bench/profile/sidebyside.sh /path/to/old/target/release target/release
set -u
OLD=$1; NEW=$2
for r in 1 2; do
  for side in old new; do
    d=$OLD; [ "$side" = new ] && d=$NEW
    echo "== round $r $side hold"; "$d/nackd-bench" hold --count 200000 2>&1 | grep -E "^(nackd|park|rss|recovered) "
    echo "== round $r $side retry"; "$d/nackd-bench" retry --seconds 5 --rates 1500 --rounds 1 --mechanisms nackd 2>&1 | grep -E "^median"
  done
done
