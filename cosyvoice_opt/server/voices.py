"""/v1/voices: list the voices, save a clone prompt under a name, delete a saved one.

A saved voice is listed with the model families it speaks with: its own and, since it holds its prompt audio, the
other one too (a voice saved without audio, format versions 1 and 2, speaks only with its own)."""

from __future__ import annotations

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cosyvoice_opt.errors import InputError, PromptTooLong
from cosyvoice_opt.frontend.text_normalize import clean_text
from cosyvoice_opt.frontend.voices import check_name
from cosyvoice_opt.limits import MAX_UPLOAD_BYTES
from cosyvoice_opt.server.base import ApiBase
from cosyvoice_opt.server.errors import ApiError
from cosyvoice_opt.server.parsing import parse_flag, read_capped

MAX_FORM_BYTES = MAX_UPLOAD_BYTES + (64 << 10)  # the file plus the other fields and multipart framing


def _file_too_large() -> ApiError:
    """A voice upload over the limit, whether the body or the file itself says so."""
    return ApiError(413, f"'file' is larger than {MAX_UPLOAD_BYTES >> 20} MiB; upload a short speech prompt (30 s "
                    "at most: far smaller).", "file", "request_too_large")


class VoiceRoutes(ApiBase):
    """/v1/voices."""

    def _voice_list(self) -> list[dict]:
        store = self.engine.voices
        builtin = [{"object": "voice", "id": n, "name": n, "type": "builtin", "prompt_text": store.prompt_text(n)}
                   for n in store.builtin_names()]
        aliases = [{"object": "voice", "id": a, "name": a, "type": "builtin", "alias_of": n}
                   for a, n in store.aliases.items()]
        speakers = [{"object": "voice", "id": n, "name": n, "type": "builtin"} for n in self._speakers()]
        saved = [self._saved_voice(n) for n in store.list()]
        return builtin + aliases + speakers + saved

    def _saved_voice(self, name: str) -> dict:
        store = self.engine.voices
        entry = {"object": "voice", "id": name, "name": name, "type": "saved"}
        try:
            entry |= {"prompt_text": store.prompt_text(name), "families": [f.value for f in store.families(name)]}
        except InputError as e:  # listed all the same (it can be deleted), with what is wrong with it
            entry["error"] = str(e)
        return entry

    async def list_voices(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await self._run(self._voice_list)})

    def _read_only(self, name: str) -> bool:
        return name in self._speakers() or self.engine.voices.builtin(name) is not None

    async def create_voice(self, request: Request) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "POST /v1/voices takes multipart/form-data with fields name, prompt_text, file and "
                           "optionally overwrite.")
        body = read_capped(request, MAX_FORM_BYTES, _file_too_large())
        parser = MultiPartParser(request.headers, body, max_files=1, max_fields=8)
        try:
            form = await parser.parse()
        except MultiPartException as e:
            raise ApiError(400, f"Malformed multipart/form-data body: {e.message}") from None
        try:
            name, prompt_text, upload = form.get("name"), form.get("prompt_text"), form.get("file")
            if not isinstance(name, str) or not name.strip():
                raise ApiError(400, "'name' is required: the name to save the voice under.", "name")
            try:
                check_name(name.strip())
            except InputError as e:
                raise ApiError(400, str(e), "name") from None
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "'file' is required: the prompt audio (wav, flac, mp3 or ogg) as a file field.",
                               "file")
            if prompt_text is not None and not isinstance(prompt_text, str):
                raise ApiError(400, "'prompt_text' must be a text field.", "prompt_text")
            if not (prompt_text or "").strip():
                raise ApiError(400, "'prompt_text' is empty: zero-shot cloning needs the transcript of the prompt "
                               "audio, word for word.", "prompt_text")
            try:  # the checks a request makes of the transcript, so that no saved voice fails every request
                clean_text(prompt_text, "'prompt_text'")
            except InputError as e:
                raise ApiError(400, f"{e}.", "prompt_text") from None
            overwrite = parse_flag(form.get("overwrite"), "overwrite")
            audio = await upload.read()
        finally:
            await form.close()
        if len(audio) > MAX_UPLOAD_BYTES:
            raise _file_too_large()
        name, prompt_text = name.strip(), prompt_text.strip()
        if self._read_only(name):
            raise ApiError(409, f"{name!r} is a built-in voice and read-only; choose another name.", "name",
                           "voice_read_only")
        existed = name in await self._run(self.engine.voices.list)
        if existed and not overwrite:
            raise ApiError(409, f"A voice named {name!r} already exists; send overwrite=true to replace it, or choose "
                           "another name.", "name", "voice_exists")
        try:
            await self._run(self.engine.save_voice, name, audio, prompt_text, overwrite=overwrite)
        except PromptTooLong as e:  # the audio passed, but with it the transcript leaves no room for text
            raise ApiError(400, str(e), "prompt_text") from None
        except InputError as e:  # the prompt audio itself was refused
            raise ApiError(400, str(e), "file") from None
        return JSONResponse({"object": "voice", "id": name, "name": name, "type": "saved", "prompt_text": prompt_text},
                            200 if existed else 201)

    async def delete_voice(self, request: Request) -> Response:
        name = request.path_params["name"]
        if self._read_only(name):
            raise ApiError(403, f"{name!r} is a built-in voice and read-only; only saved voices can be deleted.",
                           "name", "voice_read_only")
        saved = await self._run(self.engine.voices.list)
        if name not in saved:
            known = ", ".join(saved) or "none"
            raise ApiError(404, f"No saved voice {name!r}; saved voices: {known}.", "name", "voice_not_found")
        await self._run(self.engine.delete_voice, name)
        return JSONResponse({"object": "voice.deleted", "id": name, "name": name, "deleted": True})
