r"""The tag scheme of the dashboards: the TensorBoard tag of every quantity the callbacks log.

One tag scheme for classifiers and GANs (what the callbacks in :mod:`gradreg.lightning.callbacks`
write; ``<owner>`` is the submodule an optimizer updates, ``critic`` or ``generator``, and is left
out when there is one optimizer; ``<path>`` a penalty's module path, ``penalties.wgan_gp``):

=========================================  ========================================================
``loss/total[/<owner>]``                   the loss backpropagated before an optimizer step: task
                                           loss + the weighted penalties
``grad_norm/total[/<owner>]``              :math:`\lVert\partial L/\partial\theta\rVert_p` over the
                                           optimizer's parameters
``param_grad/<layer>`` (histogram)         the entries of :math:`\partial L/\partial\theta` of one
                                           layer's weights (parameters of 2+ dimensions)
``param_grad_bias/<layer>`` (histogram)    the same of its 1-D parameters (biases)
``input_grad/norm_mean|max``, histogram    per-sample :math:`\lVert\nabla_{x_i}\ell_i\rVert_p`:
``input_grad/norm``                        batch mean, max and distribution
``penalty/unweighted/<path>``              the penalty :math:`P` of its last call
``penalty/weighted/<path>``                :math:`\lambda \cdot \text{every} \cdot \text{gain}
                                           \cdot P`: the term the loss got at that call
``penalty/weight/<path>``                  :math:`\lambda`, at every logged step
``grad_split/task|penalty/<layer>``         :math:`\lVert\partial L_\text{task}/\partial
                                           \theta_l\rVert`, :math:`\lVert\partial \sum_k
                                           \lambda_k P_k/\partial\theta_l\rVert` per layer
``grad_split/penalty_share|cosine/<layer>``  the penalty's share of those norms, the cosine
                                           between the two parts
``interpolates/grad_norm_mean|target``,    :math:`\lVert\nabla D(\hat x)\rVert_2` at WGAN-GP's
histogram ``interpolates/grad_norm``       interpolates: mean, the penalty's target (1),
                                           distribution
``saliency``                               image: inputs over :math:`\lvert\nabla_x\ell\rvert`
``critic_landscape/score|grad_norm``       images: critic scores, :math:`\lVert\nabla_x D\rVert`
``samples``                                image: a grid of generated images of fixed latents,
                                           with the step and λ
``graph/autograd[/<owner>]``               image: the backward graph of the penalized loss
``autograd_graph/text|dot``                text: the same graphs, to search and to paste
=========================================  ========================================================

The modules' own ``self.log`` tags (``train/loss``, ``train/critic/adversarial``, ``val/acc``, ...)
are left as they are; the HParams table takes its metrics from them. One quantity has one tag:
the modules show their total loss and weighted penalties in the progress bar only, as
``loss/total`` and ``penalty/weighted/<path>`` are the same numbers. TensorBoard's Time Series tab
shows tag groups (the part before the first ``/``) in alphabetical order, the first open: the
names above put the scalars of ``grad_norm`` (or a GAN's critic landscape) first, and
:class:`~gradreg.lightning.dashboards.logger.TensorBoardLogger` leaves out the ``epoch`` scalar
that Lightning adds to every step.
"""

LOSS_TOTAL = "loss/total"
GRAD_NORM = "grad_norm"
PARAM_GRAD = "param_grad"
PARAM_GRAD_BIAS = "param_grad_bias"
INPUT_GRAD = "input_grad"
PENALTY_UNWEIGHTED = "penalty/unweighted"
PENALTY_WEIGHTED = "penalty/weighted"
PENALTY_WEIGHT = "penalty/weight"
INTERPOLATES = "interpolates"
SALIENCY = "saliency"
CRITIC_LANDSCAPE = "critic_landscape"
SAMPLES = "samples"
AUTOGRAD_GRAPH = "autograd_graph"  # the text; the picture is GRAPH_PICTURE
GRAPH_PICTURE = "graph/autograd"
GRAD_SPLIT = "grad_split"
