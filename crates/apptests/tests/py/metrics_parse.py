"""Parses a metrics page (stdin) with the Prometheus client library's own
parser for the format named by argv[1] ("prometheus": text format 0.0.4,
"openmetrics": OpenMetrics 1.0, which also checks the page's structure,
e.g. the closing # EOF and counter naming), and prints one line per sample:
name, labels as k=v joined by ',' in sorted order, and the value. Exits
non-zero with the parser's error when the page does not parse."""

import sys

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text


def main():
    fmt = sys.argv[1]
    text = sys.stdin.read()
    parse = {"prometheus": parse_text, "openmetrics": parse_openmetrics}[fmt]
    for family in parse(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            print(f"{family.type} {s.name} {labels} {int(s.value)}")


if __name__ == "__main__":
    main()
