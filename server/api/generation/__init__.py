"""The engine jobs of a request, shared by the protocols that run them directly: the OpenAI
routes (server.api.openai) and lightning's batch routes (server.api.lightning). Both import
from here; neither imports the other for it, and nothing here imports either.

jobs.py           the engine sequences of a request: submit (check_room first), events, abort
stream.py         ChoiceStream: a renderer's bytes as a StreamSource, direct writes included;
                  Renderer, the shape every protocol's renderer has
"""
