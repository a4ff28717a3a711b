"""What runs a resolved layout on real processes: the world's bootstrap (world.process_world), process groups per
module, boundary communicators, the step executor, the device, the progress beacon, megatron-core's CPU shims.
May import plan, runspec, data and models; the layers that build and train a run sit above it."""
