// Appended to llama.cpp's tests/test-chat.cpp by scripts/chat_cases.py, whose patch makes each
// parser test case call dump_case() instead of running: every case of
// test_template_output_peg_parsers() comes out as one JSON line, its values resolved by the
// compiler (named messages, helpers, tool constants), with what llama.cpp's own parser makes of
// its input (also with reasoning parsed, where the case leaves it unparsed) and what the chat
// endpoint would add to its request (grammar, triggers, tokens).

static const char * continuation_name(common_chat_continuation c) {
    return c == COMMON_CHAT_CONTINUATION_NONE ? "none" : "continue";
}

static json msg_json(const common_chat_msg & msg) {
    json calls = json::array();
    for (const auto & call : msg.tool_calls) {
        calls.push_back({ { "name", call.name }, { "arguments", call.arguments }, { "id", call.id } });
    }
    return {
        { "role", msg.role },
        { "content", msg.content },
        { "reasoning_content", msg.reasoning_content },
        { "tool_calls", calls },
        { "content_parts", msg.content_parts.size() },
    };
}

static void dump_case(common_chat_templates * tmpls, const std::string & template_path, peg_test_case tc) {
    if (tc.params.messages.empty()) {
        tc.params.messages = { message_user };
    }
    if (tc.expect.role.empty()) {
        tc.expect.role = "assistant";
    }
    json tools = json::array();
    for (const auto & tool : tc.params.tools) {
        tools.push_back({ { "name", tool.name }, { "description", tool.description },
                          { "parameters", json::parse(tool.parameters.empty() ? "{}" : tool.parameters) } });
    }
    json messages = json::array();
    for (const auto & msg : tc.params.messages) {
        messages.push_back(msg_json(msg));
    }
    json out = {
        { "template", template_path },
        { "input", tc.input },
        { "is_partial", tc.is_partial },
        { "enable_thinking", tc.params.enable_thinking },
        { "reasoning_format", common_reasoning_format_name(tc.params.reasoning_format) },
        { "parallel_tool_calls", tc.params.parallel_tool_calls },
        { "tool_choice", (int) tc.params.tool_choice },
        { "add_generation_prompt", tc.params.add_generation_prompt },
        { "continue_final_message", continuation_name(tc.params.continue_final_message) },
        { "json_schema", tc.params.json_schema },
        { "tools", tools },
        { "messages", messages },
        { "expect", msg_json(tc.expect) },
    };
    try {
        make_peg_parser parser(tmpls, tc.params);
        out["llama"]            = msg_json(parser.parse(tc.input, tc.is_partial));
        const auto & p          = parser.params_;
        out["format"]           = common_chat_format_name(p.format);
        out["generation_prompt"] = p.generation_prompt;
        out["grammar"]          = p.grammar;
        out["grammar_lazy"]     = p.grammar_lazy;
        json triggers           = json::array();
        for (const auto & t : p.grammar_triggers) {
            triggers.push_back({ { "type", (int) t.type }, { "value", t.value } });
        }
        out["grammar_triggers"] = triggers;
        out["preserved_tokens"] = p.preserved_tokens;
        out["additional_stops"] = p.additional_stops;
        if (tc.params.reasoning_format == COMMON_REASONING_FORMAT_NONE) {
            // The same input read with reasoning parsed: where it differs, reasoning is in play
            auto with_reasoning             = tc.params;
            with_reasoning.reasoning_format = COMMON_REASONING_FORMAT_AUTO;
            make_peg_parser auto_parser(tmpls, with_reasoning);
            out["llama_auto"] = msg_json(auto_parser.parse(tc.input, tc.is_partial));
        }
    } catch (const std::exception & e) {
        out["error"] = e.what();
    }
    std::cout << out.dump() << "\n";
}

int main() {
    common_log_set_verbosity_thold(-1);
    test_template_output_peg_parsers(false);
    return 0;
}
