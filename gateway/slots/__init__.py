"""slots: see the README's Architecture section."""
