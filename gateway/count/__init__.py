"""count: see the README's Architecture section."""
