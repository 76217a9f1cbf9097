"""gradreg's Hydra sweepers (Hydra instantiates a sweeper only from the ``hydra_plugins``
package): ``hydra/sweeper=grid`` (:class:`~hydra_plugins.gradreg_sweepers.grid.GridSweeper`)."""
