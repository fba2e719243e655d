"""MLflow "models from code" entry point for bundles: MLflow stores this file with each model and runs
it on load to build the pyfunc, so no pickled object is stored (bundles never unpickle anything)."""

import mlflow

from specops.pipeline.registry import BundleModel

mlflow.models.set_model(BundleModel())
