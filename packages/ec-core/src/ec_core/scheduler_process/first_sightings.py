"""The doorkeeper the adaptive policies share: whether a first sighting is worth a save."""

from __future__ import annotations


class FirstSightingGate:
    """The doorkeeper of the adaptive policies: whether an item seen for the first
    time is worth writing.

    First sightings are written while they have been paying off (a moving
    average of "hit before it left" at or above `admit_threshold`, or whatever
    `_first_sightings_pay` a policy defines); otherwise one in `probe_every` is
    still written, so the average keeps being measured. A written first
    sighting is on trial until it is hit or leaves.
    """

    first_sighting_payoff: float
    admit_threshold: float
    probe_every: int
    ema_weight: float
    _first_sightings: int
    _trial: set[str]

    def _let_first_sighting_in(self, key: str) -> bool:
        self._first_sightings += 1
        if self._first_sightings_pay() or self._first_sightings % self.probe_every == 0:
            self._trial.add(key)
            return True
        return False

    def _first_sightings_pay(self) -> bool:
        """Whether first sightings have been paying off enough to be written."""
        return self.first_sighting_payoff >= self.admit_threshold

    def _trial_outcome(self, key: str, paid_off: bool) -> None:
        if key in self._trial:
            self._trial.discard(key)
            self._payoff(paid_off)

    def _payoff(self, paid_off: bool) -> None:
        self.first_sighting_payoff = payoff_after(
            self.first_sighting_payoff, paid_off, self.ema_weight
        )


def payoff_after(average: float, paid_off: bool, weight: float) -> float:
    """A payoff average after one more trial: the exponential moving average, of
    weight `weight`, of outcomes 1.0 (the save was hit before it left) and 0.0."""
    return average + weight * ((1.0 if paid_off else 0.0) - average)
