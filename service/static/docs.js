// The API docs page (/docs): Swagger UI on this service's /openapi.json. A plain script, not
// a module (the bundle is Swagger UI's global build, window.SwaggerUIBundle), kept out of the
// page so that the strict Content-Security-Policy (no inline script) holds. No validator
// badge (it would call validator.swagger.io), no OAuth redirect: requests go to this origin.
window.ui = window.SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  presets: [window.SwaggerUIBundle.presets.apis],
  deepLinking: true,
  validatorUrl: null,
  showExtensions: true,
  showCommonExtensions: true,
});
