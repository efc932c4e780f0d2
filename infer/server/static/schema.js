// Checks a value against a JSON schema: the keywords structured output uses (type, enum,
// const, properties, required, additionalProperties, items, prefixItems, min/max of
// numbers, strings and arrays, pattern, anyOf/oneOf/allOf, local $ref). An unknown keyword
// is reported, not silently passed. Returns a list of "path: problem" strings (empty: valid).

const KNOWN = new Set([
  "$schema", "$id", "$defs", "definitions", "$ref", "title", "description", "default",
  "examples", "type", "enum", "const", "properties", "required", "additionalProperties",
  "items", "prefixItems", "minItems", "maxItems", "uniqueItems", "minimum", "maximum",
  "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern",
  "format", "anyOf", "oneOf", "allOf", "minProperties", "maxProperties",
]);

export function validate(value, schema) {
  const problems = [];
  check(value, schema, "$", schema, problems);
  return problems;
}

function typeOf(value) {
  if (value === null) return "null";
  if (Array.isArray(value)) return "array";
  if (typeof value === "number") return Number.isInteger(value) ? "integer" : "number";
  return typeof value;
}

function hasType(value, type) {
  const actual = typeOf(value);
  return actual === type || (type === "number" && actual === "integer");
}

function resolve(ref, root) {
  if (!ref.startsWith("#")) throw new Error(`only local $ref is supported: ${ref}`);
  let node = root;
  for (const part of ref.slice(1).split("/").filter(Boolean)) {
    node = node[part.replace(/~1/g, "/").replace(/~0/g, "~")];
    if (node === undefined) throw new Error(`unresolved $ref ${ref}`);
  }
  return node;
}

function check(value, schema, path, root, problems) {
  if (schema === true || schema === undefined) return;
  if (schema === false) {
    problems.push(`${path}: no value is allowed here`);
    return;
  }
  for (const key of Object.keys(schema)) {
    if (!KNOWN.has(key)) problems.push(`${path}: schema keyword "${key}" is not checked here`);
  }
  if (schema.$ref) check(value, resolve(schema.$ref, root), path, root, problems);
  const fail = (message) => problems.push(`${path}: ${message}`);
  if (schema.type !== undefined) {
    const types = Array.isArray(schema.type) ? schema.type : [schema.type];
    if (!types.some((t) => hasType(value, t))) {
      fail(`expected ${types.join(" or ")}, got ${typeOf(value)}`);
      return;
    }
  }
  if (schema.enum && !schema.enum.some((e) => same(e, value))) {
    fail(`must be one of ${JSON.stringify(schema.enum)}`);
  }
  if ("const" in schema && !same(schema.const, value)) {
    fail(`must be ${JSON.stringify(schema.const)}`);
  }
  const t = typeOf(value);
  if (t === "integer" || t === "number") {
    if (schema.minimum !== undefined && value < schema.minimum) fail(`below ${schema.minimum}`);
    if (schema.maximum !== undefined && value > schema.maximum) fail(`above ${schema.maximum}`);
    if (schema.exclusiveMinimum !== undefined && value <= schema.exclusiveMinimum) {
      fail(`not above ${schema.exclusiveMinimum}`);
    }
    if (schema.exclusiveMaximum !== undefined && value >= schema.exclusiveMaximum) {
      fail(`not below ${schema.exclusiveMaximum}`);
    }
    if (schema.multipleOf && !Number.isInteger(value / schema.multipleOf)) {
      fail(`not a multiple of ${schema.multipleOf}`);
    }
  }
  if (t === "string") {
    const length = [...value].length;
    if (schema.minLength !== undefined && length < schema.minLength) fail("too short");
    if (schema.maxLength !== undefined && length > schema.maxLength) fail("too long");
    if (schema.pattern && !new RegExp(schema.pattern, "u").test(value)) {
      fail(`does not match ${schema.pattern}`);
    }
  }
  if (t === "array") {
    if (schema.minItems !== undefined && value.length < schema.minItems) fail("too few items");
    if (schema.maxItems !== undefined && value.length > schema.maxItems) fail("too many items");
    if (schema.uniqueItems) {
      const seen = new Set(value.map((v) => JSON.stringify(v)));
      if (seen.size !== value.length) fail("items are not unique");
    }
    const prefix = schema.prefixItems || [];
    value.forEach((item, i) => {
      const itemSchema = i < prefix.length ? prefix[i] : schema.items;
      check(item, itemSchema, `${path}[${i}]`, root, problems);
    });
  }
  if (t === "object") {
    const properties = schema.properties || {};
    for (const name of schema.required || []) {
      if (!(name in value)) fail(`missing required property "${name}"`);
    }
    const count = Object.keys(value).length;
    if (schema.minProperties !== undefined && count < schema.minProperties) {
      fail("too few properties");
    }
    if (schema.maxProperties !== undefined && count > schema.maxProperties) {
      fail("too many properties");
    }
    for (const [name, item] of Object.entries(value)) {
      if (name in properties) check(item, properties[name], `${path}.${name}`, root, problems);
      else if (schema.additionalProperties === false) fail(`property "${name}" is not allowed`);
      else check(item, schema.additionalProperties, `${path}.${name}`, root, problems);
    }
  }
  if (schema.allOf) schema.allOf.forEach((s) => check(value, s, path, root, problems));
  for (const [keyword, wanted] of [["anyOf", (n) => n >= 1], ["oneOf", (n) => n === 1]]) {
    if (!schema[keyword]) continue;
    const passing = schema[keyword].filter((s) => {
      const inner = [];
      check(value, s, path, root, inner);
      return !inner.length;
    }).length;
    if (!wanted(passing)) fail(`matches ${passing} of the ${keyword} schemas`);
  }
}

function same(a, b) {
  return JSON.stringify(a) === JSON.stringify(b);
}
