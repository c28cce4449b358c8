"""edge: see the README's Architecture section."""
