"""Vektonn's wire format, decoded and encoded without a DTO object per data point."""
