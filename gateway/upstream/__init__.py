"""upstream: see the README's Architecture section."""
