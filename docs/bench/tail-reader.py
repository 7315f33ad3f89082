# Reads the stdout sink's JSON lines on stdin; latency = arrival − the event's timestamp (its
# insert time). Prints p50/p99/p99.9/max and the three seconds with the largest max.
import json
import sys
import time
from datetime import datetime

latencies, seconds, first = [], {}, None
for line in sys.stdin:
    arrived = time.time()
    try:
        written = datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp()
    except (ValueError, KeyError):
        continue
    first = written if first is None else first
    ms = (arrived - written) * 1000
    latencies.append(ms)
    seconds.setdefault(int(written - first), []).append(ms)


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


if latencies:
    print(f"events {len(latencies)}  p50 {quantile(latencies, .5):.1f}  p99 {quantile(latencies, .99):.1f}  "
          f"p99.9 {quantile(latencies, .999):.1f}  max {max(latencies):.1f} ms")
    worst = sorted(seconds.items(), key=lambda kv: -max(kv[1]))[:3]
    print("worst seconds: " + ", ".join(f"second {s}: max {max(v):.1f} ms" for s, v in sorted(worst)))
