"""Pure placement, quota and cost logic. No Django imports here: it is replayed by the simulator."""
