"""The cases of llama.cpp's parser tests that loopd still reads otherwise than llama.cpp, by
why (tests/test_llama_cases.py). The list only shrinks: a case read right fails its test until
it is taken off."""

BY_REASON: dict[str, list[str]] = {
    "Apriel 1.6's reasoning, opened by plain text in its generation prompt, not learned": [
        "Apriel-1.6-15b-Thinker-fixed#0",
        "Apriel-1.6-15b-Thinker-fixed#1",
    ],
    "a doubled <|channel> before Gemma 4's empty thought channel": [
        "google-gemma-4-31B-it#25",
    ],
}
KNOWN = {case: reason for reason, cases in BY_REASON.items() for case in cases}
