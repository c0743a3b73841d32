"""One HiCache instance in its own process, for the cross-instance tests of test_hicache_storage.py.

``python l3_instance.py URL write SEED NPAGES``: compute a prefix (KV from SEED), back it up,
flush to L3, print L3 counters as JSON. ``... read SEED NPAGES``: a fresh cache prefetches the
same prefix from L3, loads it back and compares its bytes with the KV regenerated from SEED.
The last stdout line is a JSON object.
"""

import json
import sys

import numpy as np

from l3_helpers import PS, bits32, compute, l3, make, read_prefix, tokens_kv


def main(url: str, role: str, seed: int, npages: int) -> dict:
    toks, kv = tokens_kv(seed, npages)
    if role == "write":
        cache = make(url)
        compute(cache, toks, kv)
        cache.flush()
        out = l3(cache)
    else:
        cache = make(url, prefetch_policy="wait_complete")
        # nothing local: only the other process computed it
        assert cache.match_prefix(toks).host_len == 0
        h = cache.prefetch(toks)
        host, dev, got = read_prefix(cache, toks)
        out = l3(cache) | {
            "pages_found": 0 if h is None else h.pages_found,
            "host_len": host,
            "bit_exact": bool(dev == npages * PS and np.array_equal(got, bits32(kv))),
        }
    cache.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
