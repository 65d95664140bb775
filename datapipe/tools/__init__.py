"""Tools on top of the engine and loaders: bench, doctor, inspect, demo, synthetic data, plots."""
