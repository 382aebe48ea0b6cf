"""The Horovod build: `tfdist-install-horovod` builds Horovod 0.28.1 from its sdist with
tfdist's patches against the installed TensorFlow, caches the wheel and installs it.

- `install`: the plan (TensorFlow, Python, MPI, GPU stack), the cache, the build and the install;
  runs by path too (`python tfdist/horovod_build/install.py`), before tfdist is installed.
- `toolchain`: the build environment (compilers, CMake, NCCL headers) and the patch set in
  `patches/` (docs/INSTALL.md lists each).
- `versions`: the declared TensorFlow / Keras / Python range.

Standard library only: nothing here imports TensorFlow or the rest of tfdist.

```bash
tfdist-install-horovod            # or: python -m tfdist.horovod_build.install
```
"""
