"""Chip backends: the seam where a device runtime plugs into a chip child."""
