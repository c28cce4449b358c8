"""tuning: see the README's Architecture section."""
