"""One step on the device, eager or replayed: the runner, device sampling and the CUDA graphs."""
