"""Secondary tiers: what lies below the CPU tier (disk tiers, and test doubles)."""
