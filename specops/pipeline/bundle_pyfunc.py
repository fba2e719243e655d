"""MLflow "models from code" entry point for bundles: MLflow stores this file with each model and runs
it on load to build the pyfunc, so no pickled object is stored (bundles never unpickle anything). The
specops package travels with the model as its code (registry.code_paths), so this import needs no
installed specops where the model is served."""

import mlflow

from specops.pipeline.registry import BundleModel

mlflow.models.set_model(BundleModel())
