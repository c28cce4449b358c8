"""Read a gateway's ``/metrics`` text the way Prometheus would."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}


@dataclass(frozen=True)
class Scrape:
    samples: list[tuple[str, dict[str, str], float]]
    # Every series name a query may use: sample names plus those a declared family can expose.
    names: frozenset[str]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``; 0 if none."""
        return sum(
            v
            for n, have, v in self.samples
            if n == name and all(have.get(k) == want for k, want in labels.items())
        )

    def has(self, name: str, **labels: str) -> bool:
        return any(
            n == name and all(have.get(k) == want for k, want in labels.items())
            for n, have, _ in self.samples
        )


def parse(text: str) -> Scrape:
    samples = []
    names = set()
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
        for sample in family.samples:
            samples.append((sample.name, dict(sample.labels), float(sample.value)))
            names.add(sample.name)
    return Scrape(samples, frozenset(names))
