"""tools: see the README's Architecture section."""
