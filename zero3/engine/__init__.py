"""The engine's face: `zero3.initialize`, the engine and its public methods (training, checkpoints, state
offloading, getters), and `build`, the one place that wires the parts it drives (zero3.passes, zero3.step)."""
