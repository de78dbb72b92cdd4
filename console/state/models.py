"""The served models: base models and LoRA adapters from the cards, joined with their figures.

Cards say what is served and by whom (topology); the frontends' scrapes say how it is going; when
no frontend reports tokens for a model, the serving workers' own prefix hit rates (load tallies)
stand in. The join is rebuilt only when topology or scrapes changed, since the Models view asks for
it on every refresh.
"""

from __future__ import annotations

from dynamod.console.state.frontends import FrontendScrapes
from dynamod.console.state.load import LoadTally
from dynamod.console.state.records import ModelInfo
from dynamod.console.state.topology import Topology
from dynamod.console.state.versions import Versions


class ModelCatalog:
    """``models()`` over the topology's cards, the frontends' figures and the workers' tallies."""

    def __init__(self, versions: Versions, topology: Topology, frontends: FrontendScrapes, load: LoadTally) -> None:
        self._versions = versions
        self._topology = topology
        self._frontends = frontends
        self._load = load
        self._cache: tuple[int, dict[str, ModelInfo]] | None = None

    def models(self) -> dict[str, ModelInfo]:
        """Served models (base and LoRA) from the cards, with their workers and frontend figures."""
        version = self._versions.topology * 1_000_003 + self._versions.models
        if self._cache is not None and self._cache[0] == version:
            return self._cache[1]
        out: dict[str, ModelInfo] = {}
        for ns, component, iid, card in self._topology.cards.values():
            worker = self._topology.worker_for(ns, component, iid)
            if worker is not None and worker.gone_at is not None:
                continue
            name = card.lora or card.served_model_name
            info = out.get(name)
            if info is None:
                info = out[name] = ModelInfo(
                    name=name,
                    base_model=card.base_model if card.lora else None,
                    model_types=list(card.model_types),
                    context_length=card.context_length,
                    kv_block_size=card.kv_block_size,
                )
            info.workers.add(iid)
        for name, stats in self._frontends.model_stats().items():
            if not name:
                continue
            info = out.get(name) or out.setdefault(name, ModelInfo(name=name))
            info.stats = stats
        tallies = self._load.stats
        for info in out.values():
            if info.stats.hit_rate is None:
                # No frontend figures: the serving workers' own prefix hit rates stand in.
                rates = [st.hit_rate for iid in info.workers if (st := tallies.get(iid)) and st.hit_rate is not None]
                if rates:
                    info.stats.hit_rate = sum(rates) / len(rates)
        self._cache = (version, out)
        return out
