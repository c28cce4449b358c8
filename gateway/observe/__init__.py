"""observe: see the README's Architecture section."""
