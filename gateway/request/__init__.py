"""request: see the README's Architecture section."""
