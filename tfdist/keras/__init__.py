"""The hooks into Keras (Keras 3 and tf-keras) that `HorovodStrategy` installs once.

Global metrics (`metrics`), gathered predictions (`predictions`), chief-only callback writes
(`callback_writes`) and model saves (`chief_saves`, `save_notices`), chief-only progress bars
(`progress`), Keras 3 batch normalisation on the fused kernel (`fused_batchnorm`), each `fit`'s
batches marked for the hang detector (`step_marks`). They recognise tfdist's strategy through
`recognise`, never by importing `tfdist.strategy`, and each fails loudly, naming itself, when the
Keras code it hooks has moved.
"""
