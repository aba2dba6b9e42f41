"""Suite-wide settings: the hypothesis profile (:mod:`hypothesis_profile`)."""

import hypothesis_profile

hypothesis_profile.load()
