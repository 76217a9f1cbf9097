"""Networks: an MLP (classifier backbone, 2D generator and critic), a small CNN, a DCGAN-style
generator and critic for images, and small vision transformers (a ViT critic, a transformer
classifier). ``gradreg.models.resnet`` (ResNet-18 for small images) needs the ``vision`` extra
and is imported by its path."""

from gradreg.models.cnn import CNN
from gradreg.models.dcgan import DCGANCritic, DCGANGenerator
from gradreg.models.layers import ACTIVATIONS
from gradreg.models.mlp import MLP
from gradreg.models.transformer import TransformerClassifier, VisionTransformer, ViTCritic

__all__ = ["ACTIVATIONS", "CNN", "MLP", "DCGANCritic", "DCGANGenerator",
           "TransformerClassifier", "ViTCritic", "VisionTransformer"]
